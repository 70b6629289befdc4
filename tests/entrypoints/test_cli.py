"""The `heron` command as vLLM users type it: the model as a flag, `python -m`, vLLM's flags, errors with the
sub-command's usage, a --help that does not wait for torch, quiet start-up probes."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from heron.entrypoints.cli import build_parser, main
from heron.entrypoints.engine_args import engine_config
from heron.entrypoints.openai.api_server import _QuietStartupProbes
from heron.entrypoints.openai.cli import resolve_model


def _serve(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    resolve_model(args)
    return args


def test_model_as_flag_or_positional(capsys):
    assert _serve("--model", "/m").model == _serve("/m").model == _serve("/m", "--model", "/m").model == "/m"
    with pytest.raises(SystemExit):
        _serve("/a", "--model", "/b")
    assert "the model is given twice" in capsys.readouterr().err


def test_vllm_flags_are_accepted(tmp_path):
    args = _serve("--trust-remote-code", "--disable-log-requests", "--disable-log-stats", "--generation-config", "vllm")
    assert args.disable_log_stats and not args.enable_log_requests
    assert engine_config(args).model.generation_config == "vllm"
    bad = engine_config(_serve("--generation-config", str(tmp_path))).model
    with pytest.raises(ValueError, match="generation_config must be"):
        bad.verify()
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    bad.verify()
    override = engine_config(_serve("--override-generation-config", '{"temperature": 0.5}')).model
    assert override.override_generation_config == {"temperature": 0.5}


def test_override_generation_config_must_be_a_json_object(capsys):
    for text, why in (("temperature=0.5", "not JSON"), ("[1]", "a JSON object")):
        with pytest.raises(SystemExit):
            _serve("--override-generation-config", text)
        assert f"--override-generation-config: {why}" in capsys.readouterr().err


def test_chunked_prefill_is_always_on():
    engine_config(_serve("--enable-chunked-prefill")).verify()  # vLLM's flag: what Heron always does
    engine_config(_serve()).verify()
    with pytest.raises(ValueError, match="enable_chunked_prefill: prefills are always chunked"):
        engine_config(_serve("--no-enable-chunked-prefill")).verify()


def test_unknown_flags_show_the_sub_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--frobnicate"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: heron serve" in err and "unrecognized arguments: --frobnicate" in err


def test_help_does_not_import_torch():
    # `heron --help` under a second: building the parser must not import torch (seconds on its own).
    code = "import sys; from heron.entrypoints.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("module", ["heron", "heron.entrypoints.openai.api_server"])
def test_python_dash_m(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("usage: heron serve" if module != "heron" else "usage: heron ") in out.stdout


def test_startup_probes_are_not_access_logged():
    state = SimpleNamespace(engine=None)
    quiet = _QuietStartupProbes(state)

    def line(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5", "GET", path, "1.1", 503)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    assert not quiet.filter(line("/health")) and not quiet.filter(line("/ping"))
    assert quiet.filter(line("/v1/models"))
    state.engine = object()  # loaded: probes are logged again
    assert quiet.filter(line("/health"))
