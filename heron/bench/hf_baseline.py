"""The baseline every benchmark compares against: Hugging Face transformers `generate` on the same requests,
the same weights, dtype and device, in the same run.

transformers has no continuous batching, so requests run in static batches: sorted by output length (then
prompt length), longest first, `batch_size` at a time, prompts left-padded to the batch's longest. A batch
generates exactly the batch's longest output length for every row: EOS is switched off (no
`eos_token_id`, `min_new_tokens` = `max_new_tokens`), since transformers can not stop a row at its own
length. Only each request's own requested tokens count as output; the rest of the row (generated after the
request would have ended) is waste that the timing includes, and that `generated_tokens` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from heron.bench.datasets import BenchRequest


@dataclass
class HFRun:
    seconds: float
    output_tokens: int  # the requests' own output lengths
    generated_tokens: int  # what transformers generated, padding rows included
    batch_size: int
    num_requests: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def load_hf_model(model: str | None, dtype: torch.dtype, device: torch.device, load_format: str = "auto"):
    """The same weights Heron loads for `model`. A Hugging Face folder or hub id goes through
    `from_pretrained`; a GGUF file (None: the embedded model) through Heron's own GGUF reader, whose
    dequantized tensors equal transformers' (tests/models/test_gguf_loader.py), since transformers'
    GGUF path needs `accelerate`, which Heron does not install. `load_format="dummy"`: transformers'
    own random initialisation in the shapes of the folder's config.json, made on the device (the values
    differ from Heron's random weights; with ignore_eos and fixed lengths the work does not depend on them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from heron.models.loader import load_source

    if load_format == "dummy":
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=dtype)
        return hf.eval()
    if model is not None and not model.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    source = load_source(model)
    cfg = dict(source.hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)  # real init: its rotary buffers are needed
    missing, unexpected = hf.load_state_dict(dict(source.weights()), strict=False)
    hf.tie_weights()
    missing = [n for n in missing if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"{source.name} does not fit transformers' {type(hf).__name__}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    hf.to(device)
    return hf.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_batch(
    hf, prompts: list[list[int]], max_new_tokens: int, temperature: float, stopping_criteria: list | None = None
) -> torch.Tensor:
    """One static batch, left-padded; returns the generated ids [B, max_new_tokens]."""
    from transformers import GenerationConfig, StoppingCriteriaList

    device = hf.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    # Sampling as Heron's SamplingParams(temperature) does it: no top-k, no top-p, no EOS.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None,
        top_p=1.0 if temperature > 0 else None,
        eos_token_id=None,
        pad_token_id=0,
    )
    out = hf.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        generation_config=config,
        stopping_criteria=StoppingCriteriaList(stopping_criteria or []),
    )
    return out[:, width:]


def run_hf(hf, requests: list[BenchRequest], batch_size: int, temperature: float, seed: int = 0) -> HFRun:
    """Time `generate` over the requests in static batches (after one small warm-up batch)."""
    device = hf.device
    torch.manual_seed(seed)
    generate_batch(hf, [requests[0].prompt_token_ids[:16]], 4, temperature)
    _sync(device)
    order = sorted(requests, key=lambda r: (r.output_len, len(r.prompt_token_ids)), reverse=True)
    seconds, generated = 0.0, 0
    for i in range(0, len(order), batch_size):
        batch = order[i : i + batch_size]
        max_new = max(r.output_len for r in batch)
        start = time.perf_counter()
        out = generate_batch(hf, [r.prompt_token_ids for r in batch], max_new, temperature)
        _sync(device)
        seconds += time.perf_counter() - start
        if out.shape[1] != max_new:
            raise RuntimeError(f"transformers generated {out.shape[1]} tokens per row, {max_new} were asked.")
        generated += out.numel()
    return HFRun(seconds, sum(r.output_len for r in requests), generated, batch_size, len(requests))


class _TokenClock:
    """A stopping criterion that never stops: it only stamps the time each generated token is ready, so that
    TTFT and decode time come from one `generate` call (differences of separate noisy runs can go negative)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf_latency(hf, prompt: list[int], output_len: int, temperature: float, iters: int) -> dict:
    """Batch 1, median of `iters` runs: TTFT = start to the first token, decode ms per token = first token
    to last / (output_len - 1), both stamped inside the same `generate` call."""
    if output_len < 2:
        raise ValueError(f"decode time needs at least 2 output tokens, got {output_len}.")
    device = hf.device

    def timed() -> dict:
        clock = _TokenClock(device)
        _sync(device)
        start = time.perf_counter()
        generate_batch(hf, [prompt], output_len, temperature, stopping_criteria=[clock])
        end = time.perf_counter()
        if len(clock.stamps) != output_len:
            raise RuntimeError(f"transformers stamped {len(clock.stamps)} tokens, {output_len} were asked.")
        return {
            "hf_decode_ms_per_token": (clock.stamps[-1] - clock.stamps[0]) / (output_len - 1) * 1e3,
            "hf_output_tokens_per_s": output_len / (end - start),
            "hf_ttft_ms": (clock.stamps[0] - start) * 1e3,
        }

    timed()  # warm-up
    runs = sorted((timed() for _ in range(iters)), key=lambda r: r["hf_decode_ms_per_token"])
    return runs[len(runs) // 2]
