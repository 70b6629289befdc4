"""The whole engine against Hugging Face transformers on the same random weights, on the GPU.

fp32: greedy tokens must be equal for 32 tokens (both backends); bf16: the last-position logits of a
prefill may be at most 1.5x as far from the fp32 logits as transformers' own bf16 logits are. Heron gets
transformers' own tensors through a ModelSource, so both run the very same weights.
Prints one line per check and exits non-zero on a failure. Gemma 2 9B's shapes (6 of its layers) run with a
128-token window, so that the prompts and the generated tokens run past it: sliding and global layers, soft caps,
head_dim 256, GeGLU.

    python benchmarks/gpu_correctness.py SHAPES_DIR [SHAPE ...]   (default: qwen3-0.6b llama3.1-8b)
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from heron import LLM, SamplingParams
from heron.models.loader import ModelSource


def hf_model(cfg: dict, dtype: torch.dtype, layers: int | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model, {**cfg, "model_type": config.model_type}


def heron_on(model, cfg: dict, dtype: str, backend: str) -> LLM:
    source = ModelSource(
        name="hf-random", hf_config=cfg, weights=lambda: iter(model.state_dict().items()), tokenizer=None
    )
    return LLM(
        source, dtype=dtype, attention_backend=backend, max_model_len=2048, max_num_seqs=16, kv_cache_memory=4 << 30
    )


def free() -> None:
    """Release what was just dropped: graphs and reference cycles keep GPU memory until collected."""
    gc.collect()
    torch.cuda.empty_cache()


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


# shape -> (decoder layers kept: None for all, config.json fields replaced)
CHECKS = {
    "qwen3-0.6b": (None, {}),
    "llama3.1-8b": (8, {}),
    "gemma2-9b": (6, {"sliding_window": 128}),
    "qwen3-30b-a3b": (4, {}),
}


def main(shapes_dir: str, shapes: list[str]) -> int:
    ok = True
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (7, 100, 333, 40)]
    for shape in shapes or CHECKS:
        layers, changes = CHECKS[shape]
        cfg = {**json.load(open(f"{shapes_dir}/{shape}/config.json")), **changes}
        # fp32, greedy, 32 tokens
        model, hf_cfg = hf_model(cfg, torch.float32, layers)
        torch.backends.cuda.matmul.allow_tf32 = False
        ref = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
            ref.append(out[0, len(p) :].tolist())
        for backend in ("torch", "triton"):
            llm = heron_on(model, hf_cfg, "float32", backend)
            got = [
                o.outputs[0].token_ids
                for o in llm.generate(
                    prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
                )
            ]
            same = sum(a == b for a, b in zip(got, ref))
            first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 32) for a, b in zip(got, ref)]
            ok &= check(
                f"{shape}{'' if layers is None else f' ({layers} layers)'} fp32 greedy 32 tokens [{backend}]",
                same == len(prompts),
                f"{same}/{len(prompts)} equal; first difference at {first_diff}",
            )
            llm = None
            free()
        with torch.no_grad():
            fp32_logits = model(torch.tensor([prompts[2]], device="cuda")).logits[0, -1].float()
        # bf16 logits of a prefill: Heron's distance from the fp32 logits against transformers' own bf16 one,
        # both on the fp32 weights rounded to bf16
        model = model.to(torch.bfloat16)
        llm = heron_on(model, hf_cfg, "bfloat16", "triton")
        captured = []
        runner_model = llm.engine.runner.model
        compute = runner_model.compute_logits
        runner_model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
        llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        with torch.no_grad():
            hf_logits = model(torch.tensor([prompts[2]], device="cuda")).logits[0, -1].float()
        rel = lambda x: ((x - fp32_logits).norm() / fp32_logits.norm()).item()
        ours, theirs = rel(captured[0][0]), rel(hf_logits)
        ok &= check(
            f"{shape} bf16 prefill logits",
            ours <= max(1.5 * theirs, 1e-2),
            f"relative error to fp32: Heron {ours:.2e}, transformers bf16 {theirs:.2e}; "
            f"Heron vs transformers {((captured[0][0] - hf_logits).norm() / hf_logits.norm()).item():.2e}",
        )
        llm = model = captured = runner_model = compute = None
        free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] or ["qwen3-0.6b", "llama3.1-8b"]))
