"""Flags from three sources: the command line, `HERON_<FLAG>` environment variables and a `--config` YAML file.

Containers and service managers configure through the environment, deployments through a checked-in file;
both reach every flag without code per flag, because the values are read off the parser's own actions (their
names, types, choices and kinds), so a flag added anywhere to a parser built with `env_prefix` works at once.
Flags override the environment, the environment overrides the file, the file overrides the defaults; a flag
that accumulates (`--api-key`) adds to what the other sources gave. A bad value is an error naming its source
(`HERON_PORT='x': ...`, `serve.yaml: max-num-seqs: ...`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigSourcesParser(argparse.ArgumentParser):
    """An ArgumentParser that, given `env_prefix`, also takes its flags from the environment and `--config`."""

    def __init__(self, *args: Any, env_prefix: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        if env_prefix is None:
            return
        self.add_argument(
            "--config",
            default=None,
            metavar="FILE.yaml",
            help=f"flags from a YAML mapping, keys as flag names (max-num-seqs: 8); env {env_prefix}CONFIG",
        )
        note = (
            f"Every flag can also be given as an environment variable {env_prefix}<FLAG> (upper case, dashes as "
            f"underscores: {env_prefix}MAX_NUM_SEQS=8; lists comma-separated; switches true/false) or as a key of "
            "the --config file. Flags override the environment, the environment overrides the file."
        )
        self.epilog = f"{self.epilog}\n\n{note}" if self.epilog else note

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.env_prefix is None:
            return super().parse_known_args(args, namespace)
        args = list(args) if args is not None else None
        values = self._from_file(args) | self._from_env()
        namespace = namespace or argparse.Namespace()
        positionals = {}
        for action, value in values.values():
            if action.option_strings:
                setattr(namespace, action.dest, value)  # argparse keeps what a namespace holds unless a flag is given
            else:
                positionals[action.dest] = (action, value)
        namespace, rest = super().parse_known_args(args, namespace)
        for dest, (action, value) in positionals.items():
            if getattr(namespace, dest) == action.default:  # an optional positional left out gets its default
                setattr(namespace, dest, value)
        return namespace, rest

    def _sourced_actions(self) -> dict[str, tuple[argparse.Action, bool]]:
        """Name (a long option without dashes, or a positional's) -> (action, whether the name negates it:
        `no-enable-prefix-caching`), for every flag and positional that holds a value."""
        out = {}
        for action in self._actions:
            if action.dest in (argparse.SUPPRESS, "config"):  # --help, --version, and the file itself
                continue
            names = [o[2:] for o in action.option_strings if o.startswith("--")] or [action.dest.replace("_", "-")]
            for name in names:
                if name in out and not out[name][0].option_strings:
                    continue  # a positional keeps its name (`model`, also a --model flag, sets the positional)
                negated = isinstance(action, argparse.BooleanOptionalAction) and name.startswith("no-")
                out[name] = (action, negated)
        return out

    def _from_env(self) -> dict[str, tuple[argparse.Action, Any]]:
        out = {}
        for name, (action, negated) in self._sourced_actions().items():
            var = f"{self.env_prefix}{name.upper().replace('-', '_')}"
            if (text := os.environ.get(var)) is not None:
                value = self._convert(action, text, f"{var}={text!r}", from_text=True)
                out[action.dest] = (action, not value if negated else value)
        return out

    def _from_file(self, args: list[str] | None) -> dict[str, tuple[argparse.Action, Any]]:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", default=os.environ.get(f"{self.env_prefix}CONFIG"))
        path = pre.parse_known_args(args)[0].config
        if path is None:
            return {}
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            self.error(f"--config {path}: {e}")
        if not isinstance(data, Mapping):
            self.error(f"--config {path}: a mapping of flag names to values expected, got {type(data).__name__}")
        actions = self._sourced_actions()
        out = {}
        for key, value in data.items():
            if (found := actions.get(str(key).replace("_", "-"))) is None:
                self.error(f"{path}: {key}: not a flag of {self.prog}")
            action, negated = found
            value = self._convert(action, value, f"{path}: {key}", from_text=False)
            out[action.dest] = (action, not value if negated else value)
        return out

    def _convert(self, action: argparse.Action, value: Any, source: str, from_text: bool) -> Any:
        """The value the flag would have stored, checked as argparse checks it; an error names `source`."""
        try:
            if action.nargs == 0:  # a switch: store_true / store_false / --[no-]flag
                on = _switch(value)
                if isinstance(action, argparse.BooleanOptionalAction):
                    return on
                return action.const if on else action.default
            many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
            if many:
                items = value.split(",") if from_text else value if isinstance(value, list) else [value]
                return [self._one(action, item) for item in items if str(item) != ""]
            return self._one(action, value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            self.error(f"{source}: {e}")

    @staticmethod
    def _one(action: argparse.Action, value: Any) -> Any:
        converted = action.type(str(value)) if callable(action.type) else str(value)
        if action.choices is not None and converted not in action.choices:
            raise ValueError(f"invalid choice {converted!r} (choose from {', '.join(map(str, action.choices))})")
        return converted


def _switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")
