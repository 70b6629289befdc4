"""Random PEFT LoRA adapters for a model folder's shapes (its config.json; the weights may be absent, as for
`--load-format dummy`), for the multi-LoRA benchmark (heron/bench/lora.py):

    python benchmarks/make_loras.py MODEL_DIR OUT_DIR [--num 8] [--rank 16]  ->  OUT_DIR/lora{0..N-1}/

Each adapter targets every projection (q/k/v/o, gate/up/down) of every layer, lora_alpha = 2 * rank, bf16
matrices of the scale a trained adapter has (A ~ N(0, 1 / in), B ~ N(0, 0.01)), written as peft's
`save_pretrained` writes them (adapter_config.json + adapter_model.safetensors) without building the model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in, out) of a dense decoder layer."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def make(cfg: dict, out: Path, rank: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes(cfg).items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
    )
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    for i in range(args.num):
        make(cfg, Path(args.out_dir) / f"lora{i}", args.rank, i)
        print(Path(args.out_dir) / f"lora{i}")


if __name__ == "__main__":
    main()
