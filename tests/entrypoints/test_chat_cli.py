"""`heron chat` with its input piped: one turn per line, the conversation kept, each answer printed; the
sampling flags reach the engine (greedy here, so the answers are those of LLM.chat)."""

from __future__ import annotations

import io

from heron import LLM, SamplingParams
from heron.entrypoints.cli import main


def test_chat_repl_over_piped_stdin(tiny_model_dir, monkeypatch, capsys):
    path = tiny_model_dir("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n\nHow are you?\n/exit\nnever read\n"))
    assert main(["chat", "--model", path, "--temperature", "0", "--max-tokens", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    llm = LLM(path)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    first = llm.chat([{"role": "user", "content": "Hello"}], greedy, use_tqdm=False)[0].outputs[0].text
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "How are you?"},
    ]
    second = llm.chat(turns, greedy, use_tqdm=False)[0].outputs[0].text
    assert "\n".join(printed).endswith(f"{first}\n{second}")
