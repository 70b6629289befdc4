"""docs/lora.md and its Korean page against the code they describe: every `heron ...` command in their bash
blocks parses with Heron's CLI, and every Python block compiles, its `LLM(...)`, `LoRARequest(...)` and
`SamplingParams(...)` calls passing only arguments those signatures take. (Running them needs a GPU-sized model
and adapter folders; tests/entrypoints/test_llm_lora.py and the server's LoRA tests run the same calls.)"""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from pathlib import Path

import pytest

from heron import LLM, LoRARequest, SamplingParams
from heron.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "docs" / "lora.md", REPO / "docs" / "ko" / "lora.md"]
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.S | re.M)
CALLABLES = {"LLM": LLM, "LoRARequest": LoRARequest, "SamplingParams": SamplingParams}


def _blocks(doc: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(doc.read_text()) if kind == lang]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_heron_commands_parse(doc):
    lines = [line for body in _blocks(doc, "bash") for line in body.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line, comments=True) for line in lines if line.startswith("heron ")]
    assert any(argv[1] == "serve" for argv in commands), "the page shows `heron serve`"
    for argv in commands:
        args, unknown = build_parser().parse_known_args(argv[1:])
        assert not unknown, f"{' '.join(argv)}: {unknown} are not Heron's flags"
        assert args.enable_lora, f"{' '.join(argv)}: without --enable-lora"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_python_blocks_call_the_api_as_it_is(doc):
    calls = 0
    for body in _blocks(doc, "python"):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLABLES:
                signature = inspect.signature(CALLABLES[node.func.id])
                args = [None] * len(node.args)
                kwargs = {kw.arg: None for kw in node.keywords}
                signature.bind(*args, **kwargs)  # a TypeError names an argument it does not take
                calls += 1
    assert calls >= 3, "the page shows the offline API"
