"""``--config run.yaml``: every command-line option of a command, as a YAML mapping; flags given on the
command line override the file; the resolved settings are saved next to the run's outputs.

Keys are option names with ``_`` or ``-`` (``max_turns`` or ``max-turns``). An unknown key is an error
that names it, the file and the closest valid key (``difflib``), before anything runs or any file is
written. Values are checked with the option's own type and choices.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any

import yaml

SKIPPED_DESTS = ("help", "config", "run", "command")


class ConfigError(ValueError):
    """A config file that cannot be used as it is."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="RUN.YAML",
                        help="YAML file of options (keys as option names); flags given here override it")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in SKIPPED_DESTS and a.option_strings}


def _convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    if value is None:
        return None
    if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = value if isinstance(value, list) else [value]
        return [_convert_one(action, key, v, where) for v in values]
    return _convert_one(action, key, value, where)


def _convert_one(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    kind = action.type
    if kind is not None:
        if isinstance(value, (dict, list)) or (kind in (int, float) and isinstance(value, bool)):
            raise ConfigError(f"{where}: {key} must be a {getattr(kind, '__name__', kind)}, got {value!r}")
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
        try:
            value = kind(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            raise ConfigError(f"{where}: {key}: {error}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def read_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's settings as ``{dest: value}``, checked against ``parser``'s options (ConfigError if not)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of option: value, got {type(data).__name__}")
    options = _options(parser)
    settings = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in options:
            close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(options))}"
            raise ConfigError(f"{path}: unknown key {raw_key!r}; {hint}")
        settings[key] = _convert(options[key], key, value, str(path))
    return settings


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None,
                      target: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse ``argv`` with the settings of its ``--config`` file as defaults of ``target`` (default ``parser``;
    a subcommand's parser when ``parser`` has subcommands). A bad file exits like a bad flag does."""
    target = target or parser
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config", default=None)
    known, _ = probe.parse_known_args(argv)
    settings = {}
    if known.config:
        try:
            settings = read_config(known.config, target)
        except ConfigError as error:
            target.error(str(error))
        target.set_defaults(**settings)
    args = parser.parse_args(argv)
    for dest, action in _options(target).items():  # a repeatable flag given here replaces the file's list
        if isinstance(action, argparse._AppendAction) and isinstance(settings.get(dest), list):
            setattr(args, dest, getattr(args, dest)[len(settings[dest]):] or settings[dest])
    return args


def resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Every option's final value, ready to write as YAML (what a rerun with ``--config`` reproduces)."""
    return {dest: getattr(args, dest) for dest in _options(parser) if hasattr(args, dest)}


def save_resolved_config(args: argparse.Namespace, parser: argparse.ArgumentParser, path: str | Path) -> Path:
    """Write :func:`resolved_config` to ``path`` (YAML) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_config(args, parser), sort_keys=False), encoding="utf-8")
    return path
