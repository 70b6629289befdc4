"""A request's structured-output fields -> the engine's `StructuredOutputsParams`: OpenAI's `response_format`
(chat, completions) and `text.format` (the Responses API), vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one constraint per request. The
constraint is turned into an xgrammar Grammar here, in the API process (engine/structured_output.build_grammar),
so that an invalid schema, regex or grammar is a 400 naming its field and never reaches the engine."""

from __future__ import annotations

from typing import Any

from heron.engine.structured_output import build_grammar
from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import SamplingRequest
from heron.sampling_params import StructuredOutputsParams


def structured_outputs_params(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint, or None. 400 for two constraints, an incomplete one, or an invalid one."""
    given = _constraints(req)
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ApiError(400, f"At most one structured output constraint per request; got {names}.", param=given[1][0])
    return checked(*given[0])


def output_format(kind: str, schema: dict[str, Any] | None, param: str) -> StructuredOutputsParams | None:
    """OpenAI's output format (chat's `response_format`, the Responses API's `text.format`) as a constraint:
    None for free text. `param` names the format in the 400 for a json_schema without its schema."""
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        if schema is None:
            raise ApiError(400, f"{param} of type json_schema needs its schema.", param=param)
        return StructuredOutputsParams(json=schema)
    return None


def checked(param: str, params: StructuredOutputsParams) -> StructuredOutputsParams:
    """`params`, once xgrammar has compiled them: an invalid schema, regex or grammar is a 400 naming `param`."""
    try:
        build_grammar(params)
    except ValueError as e:
        raise ApiError(400, f"{param} is invalid: {str(e).split(': ', 1)[-1]}", param=param) from None
    return params


def _constraints(req: SamplingRequest) -> list[tuple[str, StructuredOutputsParams]]:
    """Every constraint the request states: (the field that states it, as a client names it; its params)."""
    out = []
    fmt = req.response_format
    if fmt is not None:
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if (params := output_format(fmt.type, schema, "response_format")) is not None:
            out.append(("response_format.json_schema.schema" if schema is not None else "response_format", params))
    so = req.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        fields["json_object"] = so.json_object or None
        given = {k: v for k, v in fields.items() if v is not None}
        if len(given) != 1:
            why = "structured_outputs takes exactly one of json, regex, choice, grammar, json_object."
            raise ApiError(400, why, param="structured_outputs")
        [(name, value)] = given.items()
        out.append((f"structured_outputs.{name}", StructuredOutputsParams(**{name: value})))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            out.append((f"guided_{name}", StructuredOutputsParams(**{name: value})))
    return out
