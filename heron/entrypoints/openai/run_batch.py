"""`heron run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch API file, run in-process (no HTTP), as
`vllm run-batch` does.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`;
each output line `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in the order
requests finish. The body is read by the server's own request models and answered by its own response
building (protocol.py, serving_chat.py, serving_completion.py), so it means exactly what it means in
`heron serve`. A bad line (not JSON, an unknown url, a field the server refuses) becomes an error line with
the server's status and error body; the job goes on.

Memory stays bounded whatever the file's length: lines are read as the engine makes room (`LLM.stream`).
Every output line is written and flushed as its request finishes, so after a crash or Ctrl-C `--resume`
skips the custom_ids already in the output file (a truncated last line is cut off and its request run
again) and appends the rest: nothing written is lost or written twice.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import ValidationError
from tqdm.auto import tqdm

from heron.entrypoints.llm import LLM
from heron.entrypoints.openai.errors import ApiError, api_error
from heron.entrypoints.openai.limits import DEFAULT_MAX_SEQS_PER_REQUEST, RequestLimits, longest_token
from heron.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from heron.entrypoints.openai.serving_chat import OpenAIServingChat
from heron.entrypoints.openai.serving_completion import OpenAIServingCompletion, _prompts
from heron.entrypoints.openai.serving_tools import ToolCalling
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


def resume_output(path: str) -> set[str]:
    """The custom_ids the output file holds. Each line is written whole with its newline last, so a tail
    without one was cut short (the job was killed while writing it): it is removed, and its request runs again."""
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    with open(path, "rb+") as f:
        whole = 0  # bytes of whole lines
        for line in f:
            if not line.endswith(b"\n"):
                break
            whole += len(line)
            try:
                done.add(json.loads(line)["custom_id"])
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours: left as it is
        f.truncate(whole)
    return done


@dataclass
class Job:
    """One input line: its request, or the error that answers it at once."""

    custom_id: str | None
    url: str = ""
    request: ChatCompletionRequest | CompletionRequest | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    params: SamplingParams | None = None
    error: ApiError | None = None
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> its final output


@dataclass
class Summary:
    written: int = 0
    errors: int = 0


class BatchRunner:
    """Reads the lines into engine requests and the finished requests into output lines, with the server's
    request models and response building."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        limits = RequestLimits(
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_cfg.vocab_size,
            max_seqs_per_request=DEFAULT_MAX_SEQS_PER_REQUEST,
            max_n=min(DEFAULT_MAX_SEQS_PER_REQUEST, engine.config.scheduler.max_num_seqs),
            max_prompt_chars=engine.max_model_len * longest_token(engine.tokenizer),
        )
        names = [engine.model_name]
        # (their sync halves only: request -> SamplingParams and prompt, output -> choices; no HTTP, no admission)
        common = dict(engine=engine, served_model_names=names, metrics=None, admission=None, limits=limits)
        self.chat = OpenAIServingChat(**common)
        self.completion = OpenAIServingCompletion(**common)

    def parse(self, line: str) -> Job:
        try:
            raw = json.loads(line)
        except ValueError as e:
            return Job(None, error=ApiError(400, f"The line is not JSON: {e}"))
        if not isinstance(raw, dict):
            return Job(None, error=ApiError(400, "The line is not a JSON object."))
        job = Job(raw.get("custom_id") if isinstance(raw.get("custom_id"), str) else None, raw.get("url", ""))
        try:
            job.error = None if job.custom_id is not None else ApiError(400, "custom_id (a string) is required.")
            if job.error is None:
                self._read(job, raw)
        except ApiError as e:
            job.error = e
        except ValidationError as e:
            err = e.errors()[0]
            job.error = ApiError(400, f"{err['msg']}", param=".".join(str(p) for p in err["loc"]))
        except Exception as e:  # noqa: BLE001 - a bad line never stops the job
            job.error = api_error(e)
        return job

    def _read(self, job: Job, raw: dict) -> None:
        if raw.get("method", "POST") != "POST":
            raise ApiError(400, f"method {raw.get('method')!r} is not supported: only POST.", param="method")
        body = raw.get("body")
        if not isinstance(body, dict):
            raise ApiError(400, "body (a JSON object) is required.", param="body")
        if job.url == CHAT:
            req = ChatCompletionRequest.model_validate(body)
            serving = self.chat
            serving.model_name(req.model)
            params, _ = serving.chat_sampling_params(req)
            job.prompts = [serving.render(req.messages, req)]
        elif job.url == COMPLETIONS:
            req = CompletionRequest.model_validate(body)
            self.completion.model_name(req.model)
            if req.suffix is not None:
                raise ApiError(400, "suffix is not supported.", param="suffix")
            echo_lps = req.logprobs if req.echo and req.logprobs is not None else None
            params = self.completion.sampling_params(
                req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=echo_lps
            )
            job.prompts = _prompts(req.prompt)
        elif job.url == EMBEDDINGS:
            raise ApiError(400, "/v1/embeddings is not supported by run-batch yet.", param="url")
        else:
            raise ApiError(400, f"url {job.url!r} is not one of {CHAT}, {COMPLETIONS}.", param="url")
        if req.stream:
            raise ApiError(400, "stream is not supported in a batch.", param="stream")
        server_only = _SERVER_ONLY | ({"echo"} if job.url == CHAT else set())
        if unhandled := sorted(server_only & {k for k, v in req if v not in (None, False)}):
            field = unhandled[0]
            raise ApiError(400, f"{field} is not supported by run-batch yet (use heron serve).", param=field)
        job.request, job.params = req, params

    def response(self, job: Job, request_id: str) -> dict:
        """The line's response body, from its prompts' final outputs, as the server would answer."""
        req = job.request
        outs = [job.outputs[i] for i in range(len(job.prompts))]
        usage = UsageInfo(
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
            completion_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs),
        )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        model = self.chat.model_name(req.model)
        if job.url == CHAT:
            choices = []
            for c in outs[0].outputs:
                piece = self.chat._choice(req, (c.index, outs[0], c), ToolCalling(req, None), {})
                choices.append(
                    ChatCompletionResponseChoice(
                        index=piece.index,
                        message=ChatMessage(content=piece.delta.content or ""),
                        logprobs=piece.logprobs or (ChatChoiceLogprobs(content=[]) if req.logprobs else None),
                        finish_reason=piece.finish_reason,
                    )
                )
            resp = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        else:
            sent: dict[int, int] = {}
            choices = [
                self.completion._choice(req, (i * req.n + c.index, o, c), sent)
                for i, o in enumerate(outs)
                for c in o.outputs
            ]
            resp = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return resp.model_dump(mode="json")


# Fields whose handling lives in the server's request handlers only (tool calls, candidates, prompt logprobs,
# beams; chat's echo): a batch line that sets one is an error line, never answered as if it were not there.
_SERVER_ONLY = frozenset({"tools", "tool_choice", "best_of", "prompt_logprobs", "use_beam_search"})


def run_batch(llm: LLM, input_file: str, out, done: set[str], progress: bool = True) -> Summary:
    """Run every line of `input_file` whose custom_id is not in `done`, writing each result line to `out`
    (flushed) as it finishes."""
    runner = BatchRunner(llm)
    summary = Summary()
    jobs: dict[int, tuple[Job, int]] = {}  # engine item -> (its line's job, the prompt's index in it)
    bar = tqdm(desc="Requests", unit="req", disable=not progress, total=_count_lines(input_file) - len(done))
    tokens, start = 0, time.perf_counter()

    def write(job: Job, body: dict | None) -> None:
        nonlocal tokens
        request_id = body["id"] if body is not None else f"{_prefix(job)}-{uuid.uuid4().hex}"
        if body is not None:
            response = {"status_code": 200, "request_id": request_id, "body": body}
            tokens += body["usage"]["completion_tokens"]
            error = None
        else:
            summary.errors += 1
            response = {"status_code": job.error.status, "request_id": request_id, "body": json.loads(job.error.body())}
            error = {"code": job.error.code or str(job.error.status), "message": job.error.message}
        line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.custom_id, "response": response, "error": error}
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        summary.written += 1
        elapsed = time.perf_counter() - start
        bar.set_postfix_str(f"{tokens / elapsed:,.0f} tok/s", refresh=False)
        bar.update(1)

    def items() -> Iterator[tuple[str | list[int], SamplingParams, bool]]:
        position = 0
        with open(input_file, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                job = runner.parse(line)
                if job.custom_id is not None and job.custom_id in done:
                    continue
                if job.error is not None:
                    write(job, None)
                    continue
                special = job.url != CHAT  # the chat template holds its special tokens already
                for i, prompt in enumerate(job.prompts):
                    jobs[position] = (job, i)
                    position += 1
                    yield prompt, job.params, special

    try:
        for position, result in llm.stream(items(), ordered=False):
            job, i = jobs.pop(position)
            if job.error is not None:
                continue  # another prompt of the line failed: its error line is written
            if isinstance(result, ValueError):
                job.error = api_error(result, "messages" if job.url == CHAT else "prompt")
                write(job, None)
                continue
            job.outputs[i] = result
            if len(job.outputs) == len(job.prompts):
                write(job, runner.response(job, f"{_prefix(job)}-{uuid.uuid4().hex}"))
    finally:
        bar.close()
    return summary


def _prefix(job: Job) -> str:
    return "chatcmpl" if job.url == CHAT else "cmpl"


def _count_lines(path: str) -> int:
    """The lines of the file, for the progress bar's total and ETA (one fast pass over the bytes)."""
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
