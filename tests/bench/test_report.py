import json
import re

import pytest

from heron.bench.report import RESULT_KEYS, command_line, format_table, git_commit, make_result, save_result


def test_result_convention(tmp_path):
    result = make_result("cpu-offline-test", {"output_tokens_per_s": 12.5}, "cpu", command="heron bench x")
    assert tuple(result) == RESULT_KEYS
    assert result["gpu"] == "cpu" and result["command"] == "heron bench x"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", result["commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", result["date"])
    path = save_result(result, tmp_path / "results")
    assert path == tmp_path / "results" / "cpu-offline-test.json"
    assert json.loads(path.read_text()) == result


def test_save_refuses_an_incomplete_result(tmp_path):
    with pytest.raises(ValueError, match="commit"):
        save_result({"name": "x", "date": "", "gpu": "cpu", "command": "", "metrics": {}}, tmp_path)


def test_git_commit_is_head():
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", git_commit())


def test_command_line_names_the_console_script():
    assert (
        command_line(["/usr/bin/heron", "bench", "throughput", "--result-name", "a b"])
        == "heron bench throughput --result-name 'a b'"
    )


def test_format_table():
    text = format_table(
        [("Heron", 1234, 0.5, 2468.0, None), ("hf", 10, 2.0, 5.0, 3.25)],
        ("run", "tokens", "seconds", "tokens/s", "ratio"),
    )
    lines = text.splitlines()
    assert len(lines) == 4 and all(line.startswith("| ") and line.endswith(" |") for line in lines)
    assert "1,234" in lines[2] and "2,468" in lines[2] and "| -" in lines[2]
    assert "3.25" in lines[3]
