"""`heron serve`'s flags from the environment (HERON_<FLAG>) and a --config YAML file: precedence, every kind of
flag, errors that name their source, and flags added to the parser later working without code of their own."""

from __future__ import annotations

import argparse

import pytest

from heron.entrypoints.cli import build_parser
from heron.entrypoints.openai.server_config import api_keys, serve_engine_config


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for action in _serve_parser(build_parser())._actions:
        for option in action.option_strings:
            monkeypatch.delenv(f"HERON_{option.lstrip('-').upper().replace('-', '_')}", raising=False)
    monkeypatch.delenv("HERON_MODEL", raising=False)


def test_flags_override_env_override_file(tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text("model: some/model\nport: 7001\nhost: 10.0.0.1\nmax-num-seqs: 4\nseed: 5\n")
    args = build_parser().parse_args(["serve", "--config", str(config)])
    assert (args.model, args.port, args.host, args.max_num_seqs, args.seed) == ("some/model", 7001, "10.0.0.1", 4, 5)
    monkeypatch.setenv("HERON_PORT", "7002")
    monkeypatch.setenv("HERON_MAX_NUM_SEQS", "6")
    monkeypatch.setenv("HERON_MODEL", "env/model")
    args = build_parser().parse_args(["serve", "--config", str(config), "--port", "7003"])
    assert (args.model, args.port, args.host, args.max_num_seqs) == ("env/model", 7003, "10.0.0.1", 6)
    args = build_parser().parse_args(["serve", "flag/model", "--config", str(config)])
    assert (args.model, args.port) == ("flag/model", 7002)
    monkeypatch.setenv("HERON_CONFIG", str(config))  # the file itself may come from the environment
    assert build_parser().parse_args(["serve"]).seed == 5


def test_every_kind_of_flag(tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "served_model_name: [a, b]\n"  # underscores are accepted as well
        "no-enable-prefix-caching: true\n"
        "gpu-memory-utilization: 0.5\n"
        "scheduling-policy: priority\n"
        "enforce-eager: yes\n"
        "metrics-compat: vllm\n"
    )
    monkeypatch.setenv("HERON_ENABLE_LOG_REQUESTS", "true")
    monkeypatch.setenv("HERON_SWAP_SPACE", "1.5")
    monkeypatch.setenv("HERON_API_KEY", "k3,k4")
    args = build_parser().parse_args(["serve", "--config", str(config), "--api-key", "k1"])
    cfg = serve_engine_config(args)
    assert args.served_model_name == ["a", "b"] and cfg.model.served_model_name == "a"
    assert not cfg.cache.enable_prefix_caching and cfg.cache.gpu_memory_utilization == 0.5
    assert cfg.scheduler.policy == "priority" and cfg.enforce_eager and cfg.cache.swap_space == 1.5
    assert args.enable_log_requests and args.metrics_compat == "vllm"
    assert api_keys(args) == ["k3", "k4", "k1"]  # an accumulating flag adds to the environment's keys
    monkeypatch.setenv("HERON_ENABLE_PREFIX_CACHING", "0")
    assert not build_parser().parse_args(["serve"]).enable_prefix_caching


def test_a_flag_added_later_needs_no_code(monkeypatch):
    parser = build_parser()
    _serve_parser(parser).add_argument("--some-new-flag", type=int, default=1)
    monkeypatch.setenv("HERON_SOME_NEW_FLAG", "42")
    assert parser.parse_args(["serve"]).some_new_flag == 42


@pytest.mark.parametrize(
    "env,file,message",
    [
        ({"HERON_PORT": "eighty"}, None, "HERON_PORT='eighty'"),
        ({"HERON_SCHEDULING_POLICY": "lifo"}, None, "HERON_SCHEDULING_POLICY='lifo'"),
        ({"HERON_ENFORCE_EAGER": "maybe"}, None, "HERON_ENFORCE_EAGER='maybe'"),
        ({"HERON_CPU_THREADS": "0"}, None, "HERON_CPU_THREADS='0'"),
        ({}, "max-num-seqs: lots\n", "serve.yaml: max-num-seqs"),
        ({}, "no-such-flag: 1\n", "serve.yaml: no-such-flag: not a flag"),
        ({}, "- a list\n", "a mapping of flag names"),
        ({}, "port: [1\n", "serve.yaml"),
    ],
)
def test_a_bad_value_names_its_source(tmp_path, monkeypatch, capsys, env, file, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["serve"]
    if file is not None:
        (tmp_path / "serve.yaml").write_text(file)
        argv += ["--config", str(tmp_path / "serve.yaml")]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_says_so():
    text = " ".join(_serve_parser(build_parser()).format_help().split())
    assert "--config FILE.yaml" in text and "HERON_<FLAG>" in text
    assert "Flags override the environment, the environment overrides the file." in text
