"""`heron bench throughput --lora-adapters` and `heron bench latency --lora-adapter` end to end on the tiny
random Llama, with adapters written by benchmarks/make_loras.py (which peft reads as its own)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from heron.entrypoints.cli import main

MAKE_LORAS = Path(__file__).parents[2] / "benchmarks" / "make_loras.py"


def _make_loras():
    spec = importlib.util.spec_from_file_location("make_loras", MAKE_LORAS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_arm_against_the_base_model(tiny_model_dir, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = tiny_model_dir("llama")
    cfg = json.loads((Path(model) / "config.json").read_text())
    make = _make_loras().make
    dirs = [tmp_path / f"lora{i}" for i in range(3)]
    for i, d in enumerate(dirs):
        make(cfg, d, 4, i)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(dirs[0]))
    assert sum("lora_A" in n for n, _ in peft_model.named_parameters()) == 7 * cfg["num_hidden_layers"]

    argv = ["bench", "throughput", "--model", model, "--device", "cpu", "--kv-cache-memory-bytes", str(10 << 20)]
    argv += ["--num-prompts", "6", "--input-len-range", "5,12", "--output-len-range", "3,6", "--no-limit"]
    argv += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "4", "--lora-adapters", *map(str, dirs)]
    argv += ["--save-result", "--results-dir", str(tmp_path), "--disable-tqdm"]
    assert main(argv) == 0
    m = json.loads((tmp_path / f"cpu-lora-{Path(model).name}.json").read_text())["metrics"]
    assert m["num_adapters"] == 3 and m["num_requests"] == 6
    assert m["ratio_vs_base"] == m["base_elapsed_s"] / m["elapsed_s"] > 0
    assert m["kv_blocks"] == m["base_kv_blocks"] > 0  # both engines' caches from the same 10 MiB
    assert "ratio vs base" in capsys.readouterr().out

    argv = ["bench", "latency", "--model", model, "--device", "cpu", "--kv-cache-memory-bytes", str(10 << 20)]
    argv += ["--input-len", "8", "--output-len", "4", "--num-iters", "1", "--enable-lora", "--max-lora-rank", "4"]
    argv += ["--lora-adapter", str(dirs[1]), "--save-result", "--results-dir", str(tmp_path), "--result-name", "lat"]
    assert main(argv) == 0
    assert json.loads((tmp_path / "lat.json").read_text())["metrics"]["lora_adapter"] == str(dirs[1])
