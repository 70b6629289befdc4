"""`heron serve` flags and the EngineConfig they make, and a start refused before the model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from heron.entrypoints.cli import build_parser
from heron.entrypoints.openai.server_config import api_keys, engine_cpu_threads, serve_engine_config

ISSUE_FLAGS = [
    "--host",
    "--port",
    "--api-key",
    "--served-model-name",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--dtype",
    "--seed",
    "--swap-space",
    "--scheduling-policy",
    "--chat-template",
    "--device",
    "--uvicorn-log-level",
    "--enable-log-requests",
    "--max-waiting-requests",
    "--max-seqs-per-request",
    "--max-request-body-bytes",
    "--cpu-threads",
    "--shutdown-timeout",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
]


def _serve_parser():
    parser = build_parser()
    return next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]


def test_help_documents_every_flag():
    text = _serve_parser().format_help()
    for flag in ISSUE_FLAGS:
        assert flag in text, flag


def test_defaults(monkeypatch):
    monkeypatch.delenv("HERON_HOST", raising=False)
    monkeypatch.delenv("HERON_PORT", raising=False)
    monkeypatch.delenv("HERON_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port) == (None, "127.0.0.1", 8000)
    assert not args.enable_log_requests and args.enable_prefix_caching and api_keys(args) == []
    cfg = serve_engine_config(args)
    assert cfg.model.model is None and cfg.scheduler.policy == "fcfs" and cfg.cache.block_size == 16


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("HERON_HOST", "0.0.0.0")
    monkeypatch.setenv("HERON_PORT", "9001")
    monkeypatch.setenv("HERON_API_KEY", "k3,k4")
    args = build_parser().parse_args(["serve", "--api-key", "k1", "k2"])
    assert (args.host, args.port) == ("0.0.0.0", 9001)
    assert api_keys(args) == ["k3", "k4", "k1", "k2"]


def test_flags_reach_the_engine_config(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(
        [
            "serve",
            "some/model",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "512",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "1024",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--dtype",
            "bfloat16",
            "--seed",
            "3",
            "--swap-space",
            "1.5",
            "--scheduling-policy",
            "priority",
            "--chat-template",
            str(template),
            "--device",
            "cpu",
            "--revision",
            "v1",
            "--tokenizer-revision",
            "v2",
            "--download-dir",
            str(tmp_path),
            "--load-format",
            "safetensors",
        ]
    )
    cfg = serve_engine_config(args)
    hub = (cfg.model.revision, cfg.model.tokenizer_revision, cfg.model.download_dir, cfg.model.load_format)
    assert hub == ("v1", "v2", str(tmp_path), "safetensors")
    assert (cfg.model.model, cfg.model.served_model_name, cfg.model.max_model_len) == ("some/model", "a", 512)
    assert (cfg.model.dtype, cfg.model.seed, cfg.model.chat_template) == ("bfloat16", 3, template.read_text())
    assert (
        cfg.cache.gpu_memory_utilization,
        cfg.cache.block_size,
        cfg.cache.enable_prefix_caching,
        cfg.cache.swap_space,
    ) == (0.5, 32, False, 1.5)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.policy) == (
        8,
        1024,
        "priority",
    )
    assert cfg.device == "cpu"


def test_engine_cpu_threads(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def threads(*flags: str) -> int | None:
        args = build_parser().parse_args(["serve", *flags])
        return engine_cpu_threads(args, serve_engine_config(args))

    assert threads("--device", "cpu") == 4  # min(4, cores - 1)
    assert threads("--device", "cpu", "--cpu-threads", "7") == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads("--device", "cpu") == 3
    assert threads("--device", "cpu", "--cpu-threads", "2") == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    assert threads("--device", "cpu") == 1  # two cores: one for the engine, one for HTTP


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--scheduling-policy", "lifo"),
        ("--dtype", "int3"),
        ("--uvicorn-log-level", "loud"),
        ("--cpu-threads", "0"),
        ("--max-seqs-per-request", "-1"),
        ("--max-request-body-bytes", "big"),
    ],
)
def test_bad_choices_are_rejected(flag, value):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])


def test_structured_outputs_backend_flags_take_xgrammar_only(capsys):
    ok = ["--guided-decoding-backend", "xgrammar", "--structured-outputs-config", '{"backend": "auto"}']
    args = build_parser().parse_args(["serve", *ok])
    assert args.guided_decoding_backend == "xgrammar" and args.structured_outputs_config == {"backend": "auto"}
    for flags, says in (
        (["--guided-decoding-backend", "outlines"], "invalid choice: 'outlines'"),
        (["--structured-outputs-config", '{"backend": "guidance"}'], "'guidance' is not supported"),
        (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "disable_any_whitespace not supported"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *flags])
        assert says in capsys.readouterr().err, flags


def test_auto_tool_choice_needs_a_parser():
    from heron.entrypoints.cli import main

    args = _serve_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    with pytest.raises(SystemExit, match="requires --tool-call-parser"):
        main(["serve", "--enable-auto-tool-choice"])


def test_a_port_in_use_fails_at_once_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", str(port)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in out.stderr
    assert "Loading model" not in out.stderr and "Traceback" not in out.stderr


def test_a_model_that_cannot_load_exits_with_one_traceback(tmp_path):
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", str(missing), "--port", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stderr
    assert f"Could not load the model: the engine could not start: ValueError: model '{missing}'" in out.stderr
    assert "engine failed:\nTraceback" in out.stderr  # the engine process's traceback, where the error arose
    assert "api_server.py" not in out.stderr  # and none of the API process's frames after it


def test_tls_files_that_cannot_be_read_fail_before_the_port_is_taken(tmp_path):
    missing = str(tmp_path / "none.pem")
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--ssl-keyfile", missing, "--ssl-certfile", missing]
    out = subprocess.run(cmd + ["--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "cannot serve HTTPS: [Errno 2] No such file or directory" in out.stderr
    assert "Listening on" not in out.stderr and "Loading model" not in out.stderr
