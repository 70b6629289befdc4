"""`heron run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch API file, run without HTTP, as
`vllm run-batch` does.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/embeddings", "body"}` (embeddings with `--runner pooling`, generation without, as the server);
each output line `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in the order
requests finish. A body goes through the server's own route: its request model (a rejected field is the
server's 400, `api_server.validation_error`), then the endpoint's handler (`OpenAIServingChat.create`,
`OpenAIServingCompletion.create`, `OpenAIServingEmbedding.create`) over the same engine process (`AsyncLLM`),
so a line's response body is
the one `heron serve` returns for that request. A bad line (not JSON, no custom_id, an unknown url, a body the
server refuses) becomes an error line with the server's status and error body; the job goes on. A dead engine
stops it (what is left runs again under --resume).

Memory stays bounded whatever the file's length: lines are read as answers come back, at most a window of
4 x max_num_seqs lines in flight. Every output line is written and flushed as its request finishes, so after a
crash or Ctrl-C `--resume` skips the custom_ids already in the output file (a truncated last line is cut off
and its request run again) and appends the rest: nothing written is lost or written twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import TextIO

from pydantic import ValidationError
from tqdm.auto import tqdm

from heron.engine.async_llm import AsyncLLM
from heron.engine.data_parallel import DataParallelAsyncLLM
from heron.entrypoints.openai.admission import Admission
from heron.entrypoints.openai.api_server import runner_mismatch, validation_error
from heron.entrypoints.openai.errors import ApiError, api_error
from heron.entrypoints.openai.limits import DEFAULT_MAX_SEQS_PER_REQUEST, RequestLimits
from heron.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIBaseModel
from heron.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from heron.entrypoints.openai.serving_chat import OpenAIServingChat
from heron.entrypoints.openai.serving_completion import OpenAIServingCompletion
from heron.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from heron.entrypoints.openai.serving_engine import OpenAIServing
from heron.metrics import ServerMetrics

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
_ID_PREFIX = {CHAT: "chatcmpl", COMPLETIONS: "cmpl", EMBEDDINGS: "embd"}


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
class Line:
    """One input line: the request it asks for, or the error that answers it at once."""

    custom_id: str | None
    url: str = ""
    body: dict | None = None
    error: ApiError | None = None


@dataclass
class Answer:
    """A line's response: the status and body the server would send."""

    line: Line
    status: int
    body: dict


@dataclass
class Summary:
    written: int = 0
    errors: int = 0


class BatchRunner:
    """Answers lines with the server's routes: its request models, then its handlers over `engine`."""

    def __init__(self, engine: AsyncLLM | DataParallelAsyncLLM, served_model_names: list[str] | None = None) -> None:
        self.engine = engine
        names = served_model_names or [engine.model_name]
        admission = Admission(None)  # the window of lines in flight is the only queue
        metrics = ServerMetrics(
            names[0], engine.get_stats, lambda: admission.waiting, max_model_len=engine.max_model_len
        )
        limits = RequestLimits.of(engine.info, DEFAULT_MAX_SEQS_PER_REQUEST)
        common = dict(engine=engine, served_model_names=names, metrics=metrics, admission=admission, limits=limits)
        # url -> (request model, handler, the API's name, the runner that serves it): as the server's routes
        self.routes: dict[str, tuple[type[OpenAIBaseModel], OpenAIServing, str, str]] = {
            CHAT: (ChatCompletionRequest, OpenAIServingChat(**common), "Chat Completions API", "generate"),
            COMPLETIONS: (CompletionRequest, OpenAIServingCompletion(**common), "Completions API", "generate"),
            EMBEDDINGS: (EmbeddingRequest, OpenAIServingEmbedding(**common), "Embeddings API", "pooling"),
        }

    def parse(self, text: str) -> Line:
        """The line's envelope; its body is read by the route."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            return Line(None, error=ApiError(400, f"The line is not JSON: {e}"))
        if not isinstance(raw, dict):
            return Line(None, error=ApiError(400, "The line is not a JSON object."))
        custom_id = raw.get("custom_id")
        line = Line(custom_id if isinstance(custom_id, str) else None, raw.get("url", ""), raw.get("body"))
        if line.custom_id is None:
            line.error = ApiError(400, "custom_id (a string) is required.")
        elif raw.get("method", "POST") != "POST":
            line.error = ApiError(400, f"method {raw.get('method')!r} is not supported: only POST.", param="method")
        elif line.url not in self.routes:
            line.error = ApiError(400, f"url {line.url!r} is not one of {', '.join(self.routes)}.", param="url")
        elif not isinstance(line.body, dict):
            line.error = ApiError(400, "body (a JSON object) is required.", param="body")
        return line

    async def answer(self, line: Line) -> Answer:
        """What the server answers for the line's request; raises only when the engine has died."""
        model, serving, api, runner = self.routes[line.url]
        try:
            try:
                req = model.model_validate(line.body)
            except ValidationError as e:  # as FastAPI reports a body's errors
                raise validation_error([{**x, "loc": ("body", *x["loc"])} for x in e.errors()]) from None
            if (mismatch := runner_mismatch(self.engine.info.runner, api, runner)) is not None:
                raise mismatch
            if getattr(req, "stream", False):
                raise ApiError(400, "stream is not supported in a batch.", param="stream")
            response = await serving.create(req, None)  # (no client to hang up)
            return Answer(line, 200, response.model_dump(mode="json"))
        except Exception as e:  # noqa: BLE001 - a bad line never stops the job
            if self.engine.dead is not None:
                raise RuntimeError(f"the engine has stopped: {self.engine.dead!r}") from e
            error = e if isinstance(e, ApiError) else api_error(e)
            line.error = error
            return Answer(line, error.status, json.loads(error.body()))


def run_batch(
    engine: AsyncLLM | DataParallelAsyncLLM,
    input_file: str,
    out: TextIO,
    done: set[str],
    progress: bool = True,
    served_model_names: list[str] | None = None,
) -> Summary:
    """Run every line of `input_file` whose custom_id is not in `done`, writing each result line to `out`
    (flushed) as it finishes; a body's `model` may be any of `served_model_names` (default: the engine's name)."""
    return asyncio.run(_run(BatchRunner(engine, served_model_names), input_file, out, done, progress))


async def _run(runner: BatchRunner, input_file: str, out: TextIO, done: set[str], progress: bool) -> Summary:
    summary = Summary()
    window = 4 * runner.engine.info.max_num_seqs
    bar = tqdm(desc="Requests", unit="req", disable=not progress, total=_count_lines(input_file) - len(done))
    tokens, start = 0, time.perf_counter()

    def write(answer: Answer) -> None:
        nonlocal tokens
        line, body = answer.line, answer.body
        if line.error is None:
            request_id, error = body["id"], None
            usage = body["usage"]
            tokens += usage.get("completion_tokens", usage["prompt_tokens"])  # (an embedding's are its prompt's)
        else:
            summary.errors += 1
            request_id = f"{_ID_PREFIX.get(line.url, 'batch')}-{uuid.uuid4().hex}"
            error = {"code": line.error.code or str(line.error.status), "message": line.error.message}
        response = {"status_code": answer.status, "request_id": request_id, "body": body}
        record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response}
        out.write(json.dumps({**record, "error": error}, ensure_ascii=False) + "\n")
        out.flush()
        summary.written += 1
        bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
        bar.update(1)

    slots = asyncio.Semaphore(window)
    in_flight: set[asyncio.Task] = set()
    failures: list[BaseException] = []  # the engine's death, which ends the job

    async def run(line: Line) -> None:
        try:
            write(await runner.answer(line))
        except Exception as e:  # noqa: BLE001 - raised by the reading loop below
            failures.append(e)
        finally:
            slots.release()

    try:
        with open(input_file, encoding="utf-8") as f:
            for text in f:
                if not text.strip():
                    continue
                line = runner.parse(text)
                if line.custom_id is not None and line.custom_id in done:
                    continue
                if line.error is not None:
                    write(Answer(line, line.error.status, json.loads(line.error.body())))
                    continue
                await slots.acquire()
                if failures:
                    raise failures[0]
                task = asyncio.ensure_future(run(line))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        await asyncio.gather(*in_flight)
        if failures:
            raise failures[0]
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        bar.close()
    return summary


def _count_lines(path: str) -> int:
    """The lines of the file, for the progress bar's total and ETA (one fast pass over the bytes)."""
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
