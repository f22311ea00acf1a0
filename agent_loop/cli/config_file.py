"""``--config run.yaml``: a command's options as a YAML mapping; flags given on the command line override
the file; the resolved settings are saved next to the run's outputs and rerun it.

Keys are option names with ``_`` or ``-`` (``max_turns`` or ``max-turns``). An unknown key is an error
that names it, the file and the closest valid key (``difflib``), or, for an option of an earlier version
(:data:`REPLACED`), what replaced it, before anything runs or any file is written. Values are checked by the
options' own declarations (``agent_loop.cli.flags.validate``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from agent_loop.options import OptionError, options_view

# Options of earlier versions that a saved config file or a script may still give: refused in one line naming
# what replaced them, where that option exists (``{name}``: the option as a flag or as a key)
REPLACED = {"rollout_servers": ("server", "use {server}, once per server URL"),
            "off_policy": ("max_staleness", "use {max_staleness} 1")}


class ConfigError(ValueError):
    """A config file that cannot be used as it is."""


def replaced(name: str, options) -> OptionError | None:
    """The error for ``name`` if it is an option of an earlier version whose replacement is among ``options``."""
    if name in REPLACED and REPLACED[name][0] in options:
        return OptionError(name, "no longer an option; " + REPLACED[name][1])
    return None


def read_config(path: str | Path, cls) -> dict[str, Any]:
    """The file's settings as ``{field: value}`` for the options dataclass ``cls`` (ConfigError for a
    missing file, bad YAML, or a key that is not one of its fields). A single value for a list option
    is a list of one."""
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
    cls = options_view(cls)  # a composed class (TrainConfig): its sub-configs' options, one key each
    hints, names = typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]
    settings = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if (error := replaced(key, names)) is not None:
            raise ConfigError(f"{path}: {error.render(str)}")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(names))}"
            raise ConfigError(f"{path}: unknown key {raw_key!r}; {hint}")
        is_list = list in (typing.get_origin(hints[key]), *map(typing.get_origin, typing.get_args(hints[key])))
        settings[key] = [value] if is_list and value is not None and not isinstance(value, list) else value
    return settings


def save_config(settings: dict[str, Any], path: str | Path) -> Path:
    """Write ``settings`` (option: value) to ``path`` as YAML (what a rerun with ``--config`` reads) and
    return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    return path
