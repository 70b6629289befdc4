"""The usage pages against the code they describe: every `heron ...` command in their bash blocks parses with
Heron's CLI, and every Python block compiles, its `LLM(...)`, `LoRARequest(...)` and `SamplingParams(...)` calls
passing only arguments those signatures take. (Running them needs GPU-sized models and adapter folders; the
tests of those features run the same calls.)"""

from __future__ import annotations

import ast
import inspect
import shlex

import pytest

from heron import LLM, LoRARequest, SamplingParams
from heron.entrypoints.cli import build_parser
from tests.docs import FENCE, REPO

# page -> a flag one of its commands must show (the page's subject)
PAGES = {
    "docs/lora.md": "--enable-lora",
    "docs/ko/lora.md": "--enable-lora",
    "docs/ko/quantization.md": "--quantization",
}
CALLABLES = {"LLM": LLM, "LoRARequest": LoRARequest, "SamplingParams": SamplingParams}


def _blocks(page: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((REPO / page).read_text()) if kind == lang]


@pytest.mark.parametrize("page", PAGES)
def test_heron_commands_parse(page):
    lines = [line for body in _blocks(page, "bash") for line in body.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line, comments=True) for line in lines if line.startswith("heron ")]
    for argv in commands:
        _, unknown = build_parser().parse_known_args(argv[1:])
        assert not unknown, f"{' '.join(argv)}: {unknown} are not Heron's flags"
    assert any(PAGES[page] in argv for argv in commands), f"no command of the page shows {PAGES[page]}"


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_call_the_api_as_it_is(page):
    calls = 0
    for body in _blocks(page, "python"):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLABLES:
                signature = inspect.signature(CALLABLES[node.func.id])
                kwargs = {kw.arg: None for kw in node.keywords}
                signature.bind(*[None] * len(node.args), **kwargs)  # a TypeError names an argument it does not take
                calls += 1
    assert calls >= 2, "the page shows the offline API"
