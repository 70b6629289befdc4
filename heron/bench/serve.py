"""Load an OpenAI-compatible server with streamed requests; report TTFT, TPOT, ITL, E2EL and throughput.

  heron serve &                                       # or `vllm serve ...`, SGLang, any OpenAI-style server
  heron bench serve --request-rate inf --num-prompts 200
  heron bench serve --request-rate 1,4,16,inf --save-result    # a sweep: a JSON per rate, a plot, a report

The client speaks HTTP only and never imports the engine, so the same command measures other servers on
the same requests. Requests arrive as a Poisson process (--burstiness 1; other values: a gamma process),
at most --max-concurrency in flight. Each streams with stream_options.include_usage, so output tokens are
the server's own count; the model's tokenizer counts them when a server sends no usage.

Per request: TTFT (send to first text), ITL (every gap between text chunks), E2EL (send to end of stream)
and TPOT = (E2EL - TTFT) / (output tokens - 1). Failed requests are counted and their errors summarised.

Length: the whole client of one command (workloads, the streaming HTTP client, the arrival schedule, its flags),
read top to bottom; the report it prints and saves is serve_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

from heron.bench import serve_report
from heron.bench.gpu_monitor import format_summary, maybe_monitor
from heron.bench.serve_report import PERCENTILE_METRICS, api_url

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DATASETS = ("random", "sharegpt", "jsonl")


# -- the workload: text prompts with their output lengths ---------------------------------------------------


@dataclass(frozen=True)
class TextRequest:
    prompt: str
    prompt_len: int | None  # by the client's tokenizer (None without one); the server's usage replaces it
    output_len: int  # max_tokens; the exact output length with --ignore-eos
    system: str | None = None  # a system prompt shared with other requests (the prefix workload)


def random_requests(
    tokenizer, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[TextRequest]:
    """The offline benchmarks' random token prompts (datasets.random_token_requests, same draws), decoded to
    text that the server re-tokenizes to the drawn length, give or take a token where BPE merges across
    the pieces. Ids the tokenizer treats as special are dropped and replaced."""
    from heron.bench.datasets import random_token_requests

    max_id = min(10000, len(tokenizer) - 1)
    drawn = random_token_requests(num_prompts, input_len, output_len, seed, max_token_id=max_id)
    rng = random.Random(seed)
    out = []
    for r in drawn:
        text, n = _text_of_length(tokenizer, r.prompt_token_ids, len(r.prompt_token_ids), rng, max_id)
        out.append(TextRequest(text, n, r.output_len))
    return out


def shared_prefix_text_requests(
    tokenizer,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    question_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[TextRequest]:
    """The offline prefix workload (datasets.shared_prefix_requests, same draws) as text: each system prompt
    and each question decoded to text of its drawn length, as `random_requests` does."""
    from heron.bench.datasets import shared_prefix_requests

    max_id = min(10000, len(tokenizer) - 1)
    drawn = shared_prefix_requests(num_prompts, num_prefixes, prefix_len, question_len, output_len, seed, max_id)
    rng = random.Random(seed)
    systems: dict[int, tuple[str, int]] = {}
    out = []
    for r in drawn:
        if r.prefix_id not in systems:
            systems[r.prefix_id] = _text_of_length(tokenizer, r.prompt_token_ids[:prefix_len], prefix_len, rng, max_id)
        system, system_len = systems[r.prefix_id]
        question = r.prompt_token_ids[prefix_len:]
        text, n = _text_of_length(tokenizer, question, len(question), rng, max_id)
        out.append(TextRequest(text, system_len + n, r.output_len, system))
    return out


def _text_of_length(tokenizer, ids: list[int], target: int, rng: random.Random, max_id: int) -> tuple[str, int]:
    text = ""
    for _ in range(4):  # decode / re-encode until the length holds; it nearly always does by the second pass
        ids = (ids + [rng.randint(0, max_id) for _ in range(target - len(ids))])[:target]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
    return text, len(ids)


def sharegpt_requests(path: str, tokenizer, num_prompts: int, seed: int) -> list[TextRequest]:
    """ShareGPT JSON: the first human turn is the prompt, the reply's token count the output length.
    Conversations are shuffled with the seed; the filter is vLLM's, so that figures compare: prompt and
    reply of 4 tokens at least, a prompt of 1024 at most, both together 2048 at most."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}.")
    data = list(data)
    random.Random(seed).shuffle(data)
    out = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        first = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if first is None or first + 1 >= len(turns):
            continue
        prompt, reply = turns[first]["value"], turns[first + 1]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        out.append(TextRequest(prompt, prompt_len, output_len))
        if len(out) == num_prompts:
            break
    return out


def jsonl_requests(path: str, tokenizer, num_prompts: int) -> list[TextRequest]:
    """One JSON object a line: {"prompt": str, "output_len": int}; the first --num-prompts lines, in order."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) == num_prompts:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            prompt, output_len = row.get("prompt"), row.get("output_len")
            if not isinstance(prompt, str) or not isinstance(output_len, int) or output_len < 1:
                raise ValueError(
                    f"{path}:{lineno}: each line needs a string 'prompt' and a positive int "
                    f"'output_len', got {line.strip()[:200]!r}."
                )
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer else None
            out.append(TextRequest(prompt, prompt_len, output_len))
    return out


def load_workload(args: argparse.Namespace, tokenizer) -> list[TextRequest]:
    if args.dataset_name in ("sharegpt", "jsonl") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path.")
    if args.dataset_name in ("random", "sharegpt") and tokenizer is None:
        raise ValueError(
            f"--dataset-name {args.dataset_name} needs the model's tokenizer: pass --tokenizer "
            f"(a Hugging Face folder or hub id, or a .gguf file)."
        )
    if args.dataset_name == "random" and args.shared_prefix_len:
        return shared_prefix_text_requests(
            tokenizer,
            args.num_prompts,
            args.num_shared_prefixes,
            args.shared_prefix_len,
            _length_range(args.random_input_len, args),
            _length_range(args.random_output_len, args),
            args.seed,
        )
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            _length_range(args.random_input_len, args),
            _length_range(args.random_output_len, args),
            args.seed,
        )
    if args.dataset_name == "sharegpt":
        requests = sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.seed)
    else:
        requests = jsonl_requests(args.dataset_path, tokenizer, args.num_prompts)
    if not requests:
        raise ValueError(f"{args.dataset_path} holds no usable request.")
    if len(requests) < args.num_prompts:
        print(
            f"warning: {args.dataset_path} gave {len(requests)} requests, fewer than --num-prompts {args.num_prompts}",
            file=sys.stderr,
        )
    return requests


def _length_range(text: str, args: argparse.Namespace) -> tuple[int, int]:
    """'1024' with --random-range-ratio r -> [1024 (1 - r), 1024 (1 + r)]; 'LOW,HIGH' as it is."""
    from heron.bench.datasets import parse_range

    low, high = parse_range(text)
    if low != high:
        if args.random_range_ratio:
            raise ValueError("--random-range-ratio applies to a single length, not to a range LOW,HIGH.")
        return low, high
    r = args.random_range_ratio
    return max(1, int(low * (1 - r))), int(low * (1 + r))


@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer: str | None, model: str):
    """--tokenizer (a Hugging Face folder or hub id, or a .gguf file), else the served model's name when it
    is the embedded model or something AutoTokenizer can open; None when nothing can be found. Cached: a
    GGUF tokenizer takes seconds to build, and a process may run several benchmarks."""
    from transformers import AutoTokenizer

    from heron.models.loader import EMBEDDED_NAME, embedded_model_path

    try:
        name = tokenizer or (embedded_model_path() if model == EMBEDDED_NAME else model)
        if name.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(name)), gguf_file=os.path.basename(name)
            )
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # not on disk, no network, not a tokenizer: only some datasets need one
        if tokenizer is not None:
            raise ValueError(f"--tokenizer {tokenizer!r} could not be loaded ({type(e).__name__}: {e}).") from e
        print(
            f"warning: no tokenizer for model {model!r} ({type(e).__name__}: {e}); output tokens will be the "
            f"server's usage, or the number of text chunks where it sends none",
            file=sys.stderr,
        )
        return None


# -- the client: one streamed request, timed ----------------------------------------------------------------


@dataclass
class RequestResult:
    index: int
    prompt_len: int | None  # the server's usage.prompt_tokens when it sends usage
    output_len: int  # asked (max_tokens)
    success: bool = False
    error: str | None = None
    status: int | None = None  # HTTP status; None when no response came
    start: float = 0.0  # time.perf_counter() when sent
    end: float = 0.0  # ... when the stream ended or failed
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    usage: dict | None = None  # the server's, as sent
    output_tokens: int = 0
    output_tokens_source: str = ""  # "usage", "tokenizer" or "chunks"

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


class Client:
    def __init__(
        self,
        session,
        base_url: str,
        endpoint: str,
        model: str,
        api_key: str | None,
        ignore_eos: bool,
        temperature: float,
        tokenizer,
    ) -> None:
        self.session, self.model, self.ignore_eos, self.tokenizer = session, model, ignore_eos, tokenizer
        self.temperature = temperature
        self.url = api_url(base_url, endpoint)
        self.chat = endpoint == "/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def payload(self, req: TextRequest) -> dict:
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
        }
        if self.chat:
            system = [{"role": "system", "content": req.system}] if req.system else []
            body.update(
                messages=[*system, {"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len
            )
        else:
            body.update(prompt=(req.system or "") + req.prompt, max_tokens=req.output_len)
        if self.ignore_eos:  # a vLLM extra, sent only when asked: OpenAI itself rejects unknown fields
            body["ignore_eos"] = True
        return body

    async def send(self, index: int, req: TextRequest) -> RequestResult:
        result = RequestResult(index, req.prompt_len, req.output_len)
        pieces: list[str] = []
        result.start = last = time.perf_counter()
        try:
            async with self.session.post(self.url, json=self.payload(req), headers=self.headers) as resp:
                result.status = resp.status
                if resp.status != 200:
                    result.error = http_error(resp.status, await resp.text())
                    return result
                async for line in resp.content:  # one SSE field a line; "data: {chunk}" is the only one read
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # the server failed mid-stream, after its 200
                        result.error = "stream error: " + error_message(chunk)
                        return result
                    if chunk.get("usage"):
                        result.usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                        if text:
                            now = time.perf_counter()
                            if result.ttft is None:
                                result.ttft = now - result.start
                            else:
                                result.itl.append(now - last)
                            last = now
                            pieces.append(text)
        except Exception as e:  # refused, reset, timed out, a malformed chunk: counted as failed, never raised
            result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return result
        finally:
            result.end = time.perf_counter()
        result.e2el = result.end - result.start
        if result.ttft is None:  # no text at all (an immediate EOS, say): the first token came with the end
            result.ttft = result.e2el
        result.success = True
        self._count_tokens(result, "".join(pieces), len(pieces))
        return result

    def _count_tokens(self, result: RequestResult, text: str, chunks: int) -> None:
        usage = result.usage or {}
        if usage.get("completion_tokens") is not None:
            result.output_tokens, result.output_tokens_source = usage["completion_tokens"], "usage"
            if usage.get("prompt_tokens") is not None:
                result.prompt_len = usage["prompt_tokens"]
        elif self.tokenizer is not None:
            result.output_tokens = len(self.tokenizer.encode(text, add_special_tokens=False))
            result.output_tokens_source = "tokenizer"
        else:
            result.output_tokens, result.output_tokens_source = chunks, "chunks"


def error_message(body) -> str:
    """OpenAI's {"error": {"message": ...}}, FastAPI's {"detail": ...}, or the body itself."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err is not None:
            return str(err)
    return str(body)


def http_error(status: int, text: str) -> str:
    try:
        message = error_message(json.loads(text))
    except ValueError:
        message = text.strip()[:500] or "(empty body)"
    return f"HTTP {status}: {message}"


# -- a run: arrivals, concurrency, progress -----------------------------------------------------------------


async def run_at_rate(
    client: Client,
    requests: list[TextRequest],
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send every request, the gaps between arrivals drawn from gamma(burstiness, 1 / (rate * burstiness))
    (exponential, so Poisson arrivals, at burstiness 1; all at once at rate inf). Arrivals keep to their
    schedule whatever the server does: a slow server makes requests pile up, as real users would.
    Returns the results in request order and the run's duration (first send to last end)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", unit="req", disable=not show_progress)

    async def one(i: int, req: TextRequest) -> RequestResult:
        async with limit:  # TTFT counts from the send, not from the wait for a free slot
            result = await client.send(i, req)
        bar.update()
        return result

    tasks = []
    start = time.perf_counter()
    arrival = 0.0
    for i, req in enumerate(requests):
        if i and math.isfinite(rate):
            arrival += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
            delay = start + arrival - time.perf_counter()  # from the schedule, so sleeps do not drift
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def served_models(session, base_url: str, api_key: str | None) -> dict[str, str | None]:
    """GET /v1/models: each served name -> the model behind it (`root`, its folder or hub id, as vLLM and Heron
    report it), in the server's order; the first is what --model defaults to."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(api_url(base_url, "/v1/models"), headers=headers) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models failed ({http_error(resp.status, text)}); pass --model.")
        models = json.loads(text).get("data") or []
    if not models:
        raise RuntimeError("the server lists no model; pass --model.")
    return {m["id"]: m.get("root") for m in models}


async def benchmark(args: argparse.Namespace) -> int:
    try:
        import aiohttp
    except ImportError:
        raise ImportError("heron bench serve needs aiohttp: pip install aiohttp (or heron[bench])") from None

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # No connection cap: --max-concurrency is the only limit on requests in flight.
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as session:
        try:
            try:
                models = await served_models(session, args.base_url, args.api_key)
            except RuntimeError:
                if args.model is None:
                    raise
                models = {}  # the requests will say what is wrong
            model = args.model or next(iter(models))
        except (aiohttp.ClientError, OSError) as e:
            print(f"error: cannot reach {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        offline = offline_throughput(args.offline_result) if args.offline_result else None
        # The tokenizer of the model behind the name: --served-model-name may hide its folder.
        tokenizer = load_tokenizer(args.tokenizer, models.get(model) or model)
        requests = load_workload(args, tokenizer)
        client = Client(
            session, args.base_url, args.endpoint, model, args.api_key, args.ignore_eos, args.temperature, tokenizer
        )
        print(f"{len(requests)} requests ({args.dataset_name}) to {client.url}, model {model}")

        if args.warmup_requests:
            warm = await asyncio.gather(
                *(client.send(i, requests[i % len(requests)]) for i in range(args.warmup_requests))
            )
            if not any(r.success for r in warm):
                print(f"error: every warmup request failed: {warm[0].error}", file=sys.stderr)
                return 1

        config = dict(
            base_url=args.base_url,
            endpoint=args.endpoint,
            model=model,
            tokenizer=args.tokenizer,
            dataset_name=args.dataset_name,
            dataset_path=args.dataset_path,
            num_prompts=len(requests),
            random_input_len=args.random_input_len,
            random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio,
            shared_prefix_len=args.shared_prefix_len,
            num_shared_prefixes=args.num_shared_prefixes,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            seed=args.seed,
            offline_result=args.offline_result,
            warmup_requests=args.warmup_requests,
            goodput_ms=dict(args.goodput or ()),
            percentile_metrics=args.percentile_metrics,
            metric_percentiles=args.metric_percentiles,
        )
        name = args.label or f"serve-{slug(model)}"
        runs = []
        for rate in args.request_rate:
            monitor = maybe_monitor(args.gpu_monitor)
            with monitor or contextlib.nullcontext():
                results, duration = await run_at_rate(
                    client, requests, rate, args.burstiness, args.max_concurrency, args.seed, not args.disable_tqdm
                )
            run_config = dict(config, request_rate=rate if math.isfinite(rate) else "inf")
            run_name = name if len(args.request_rate) == 1 else f"{name}-rate-{rate:g}"
            result = serve_report.make_run_result(
                run_name, results, duration, run_config, dict(args.metadata), offline, args.save_detailed
            )
            print(serve_report.format_run(result))
            if monitor is not None:
                result["gpu_monitor"] = monitor.record()
                print(format_summary(result["gpu_monitor"]))
            if args.save_result:
                print(f"saved {serve_report.save_result(result, args.result_dir)}")
            runs.append(result)

    if len(runs) > 1:
        png, md = serve_report.write_sweep(runs, name, args.result_dir)
        print(f"sweep: {png}, {md}")
    return 0 if all(r["metrics"]["completed"] for r in runs) else 1


def offline_throughput(path: str) -> float:
    """output_tokens_per_s of a recorded `heron bench throughput` result."""
    with open(path) as f:
        value = json.load(f).get("metrics", {}).get("output_tokens_per_s")
    if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{path} has no positive metrics.output_tokens_per_s (a `heron bench throughput` result).")
    return float(value)


def slug(model: str) -> str:
    """'Qwen/Qwen3-0.6B' -> 'qwen3-0.6b': the model part of a default result name."""
    name = model.rstrip("/").split("/")[-1].removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name.lower())


def main(args: argparse.Namespace) -> int:
    try:
        import uvloop  # the server's loop too; the client must not be what limits a fast server

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        validate(args)
        return run(benchmark(args))
    except (ValueError, OSError, ImportError) as e:  # a bad dataset or tokenizer: the message names it
        print(f"error: {e}", file=sys.stderr)
        return 2


# -- the command line -----------------------------------------------------------------------------------------


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rates are numbers or inf, comma-separated, got {text!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive, got {text!r}")
    return rates


def _choices_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}, got {text!r}")
        return names

    return parse


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"percentiles are numbers, comma-separated, got {text!r}") from None
    if any(not 0 < p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles lie in (0, 100], got {text!r}")
    return ps


def _slo(text: str) -> tuple[str, float]:
    metric, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if metric not in ("ttft", "tpot", "e2el") or not value >= 0:
        raise argparse.ArgumentTypeError(f"a goodput SLO is ttft:MS, tpot:MS or e2el:MS, got {text!r}")
    return metric, value


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"metadata is KEY=VALUE, got {text!r}")
    return key, value


def _length(text: str) -> str:
    from heron.bench.datasets import parse_range

    try:
        low, high = parse_range(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a length is N or LOW,HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"a length range needs 1 <= LOW <= HIGH, got {text!r}")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from heron.bench.report import RESULTS_DIR

    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the server (default {DEFAULT_BASE_URL})")
    g.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS)
    g.add_argument("--model", default=None, help="the model name sent (default: the first of GET /v1/models)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder, hub id or .gguf file, for the random and sharegpt datasets and for servers "
        "that send no usage (default: the model's, or the embedded model's)",
    )
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")

    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON or the JSONL file")
    g.add_argument("--num-prompts", type=_positive_int, default=1000)
    g.add_argument(
        "--random-input-len",
        type=_length,
        default="1024",
        help="prompt tokens: N (spread by --random-range-ratio) or LOW,HIGH (default 1024)",
    )
    g.add_argument(
        "--random-output-len", type=_length, default="128", help="output tokens: N or LOW,HIGH (default 128)"
    )
    g.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="random dataset: requests open with one of --num-shared-prefixes system prompts of this many tokens "
        "(the chat endpoint's system message; prepended to the prompt on /v1/completions), then a question of "
        "--random-input-len tokens",
    )
    g.add_argument("--num-shared-prefixes", type=_positive_int, default=16)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [N (1 - r), N (1 + r)] (default 0: exactly N)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly the asked output lengths (a vLLM extra; Heron, vLLM, SGLang take it)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature sent (default 0: greedy; `heron bench throughput` uses 0.6)",
    )
    g.add_argument("--seed", type=int, default=0, help="the workload's and the arrivals' seed")

    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=_rates,
        default=[math.inf],
        help="requests/s, inf for all at once; a comma list (1,4,inf) runs a sweep (default inf)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 steadier (default 1)",
    )
    g.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight at most")
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="sent at once before measuring, not counted; if all fail, nothing is run (default 1)",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    g = parser.add_argument_group("report")
    g.add_argument(
        "--percentile-metrics",
        type=_choices_list(PERCENTILE_METRICS),
        default=list(PERCENTILE_METRICS),
        help="default ttft,tpot,itl,e2el",
    )
    g.add_argument(
        "--metric-percentiles", type=_percentiles, default=[50.0, 90.0, 95.0, 99.0], help="default 50,90,95,99"
    )
    g.add_argument(
        "--goodput",
        type=_slo,
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs (ttft:MS tpot:MS e2el:MS); goodput = requests/s meeting all of them",
    )
    g.add_argument(
        "--save-result",
        action="store_true",
        help="write <result-dir>/<label>.json (a sweep: <label>-rate-R.json per rate): summary figures",
    )
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: also each request's timings and usage (large; not for recorded results)",
    )
    g.add_argument(
        "--gpu-monitor",
        action="store_true",
        help="sample this machine's GPU (utilisation, memory, power, SM clock; NVML) every 100 ms into each result",
    )
    g.add_argument(
        "--result-dir",
        "--results-dir",
        dest="result_dir",
        default=RESULTS_DIR,
        help=f"for results, and a sweep's plot and report (default {RESULTS_DIR})",
    )
    g.add_argument(
        "--offline-result",
        default=None,
        metavar="JSON",
        help="a `heron bench throughput` result on the same requests: adds ratio_vs_offline (served "
        "output tokens/s over offline) to the metrics",
    )
    g.add_argument("--label", default=None, help="the result's name (default serve-<model>)")
    g.add_argument(
        "--metadata",
        type=_key_value,
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="recorded in the result as they are",
    )


def validate(args: argparse.Namespace) -> None:
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {args.burstiness}.")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must lie in [0, 1), got {args.random_range_ratio}.")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be non-negative, got {args.warmup_requests}.")
