"""Options declared once, for the command line and for config files.

A command's options are one dataclass; each field is declared as
``name: Annotated[type, Field(constraints, description=help)] = default`` (pydantic's ``Field``:
``ge``/``gt``/``le``/``lt``, ``Literal[...]`` for a fixed set of choices, ``AfterValidator`` for a
check of its own that raises ``ValueError("what is wrong; what is allowed")``). From that one place:

- :func:`build_parser` makes the argparse parser, with help text naming each option's allowed values
  and default;
- :func:`validate` checks a dict of values (parsed flags, or the keys of a config file) with pydantic
  and turns the first problem into a one-line :class:`UsageError` naming the option, its value and
  what is allowed. The CLI prints it and exits with status 2, before any model, engine, server or
  file is touched.

Give the dataclass ``__pydantic_config__ = STRICT_NUMBERS`` to refuse nan and inf. It stays a plain dataclass: constructing it in code does not validate (the trainer and the
tests build configs directly); :func:`validate` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import ConfigDict, TypeAdapter, ValidationError

STRICT_NUMBERS = ConfigDict(allow_inf_nan=False)  # a dataclass's __pydantic_config__: no nan/inf values
from pydantic.fields import FieldInfo

USAGE_EXIT = 2  # exit status of a usage error (argparse's too)


class UsageError(ValueError):
    """A bad option or config value: one line naming the option, its value and what is allowed."""


def closest(name: str, choices) -> str:
    """``"; did you mean X?"`` for the nearest of ``choices``, or ``""``."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else ""


def one_of(choices) -> str:
    return "one of " + ", ".join(str(c) for c in choices)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _declared(cls) -> dict[str, tuple[Any, FieldInfo]]:
    """field name -> (base type, pydantic FieldInfo merged from the Annotated metadata)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    declared = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if typing.get_origin(hint) is typing.Annotated:
            base, *extras = typing.get_args(hint)
            info = FieldInfo.merge_field_infos(*[e for e in extras if isinstance(e, FieldInfo)]) \
                if any(isinstance(e, FieldInfo) for e in extras) else FieldInfo()
        else:
            base, info = hint, FieldInfo()
        declared[field.name] = (base, info)
    return declared


def _without_none(kind):
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0], True
    return kind, False


def _bounds(info: FieldInfo) -> str:
    low = high = ""
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = f">= {m.ge}"
        elif isinstance(m, annotated_types.Gt):
            low = f"> {m.gt}"
        elif isinstance(m, annotated_types.Le):
            high = f"<= {m.le}"
        elif isinstance(m, annotated_types.Lt):
            high = f"< {m.lt}"
    return " and ".join(b for b in (low, high) if b)


def allowed(cls, name: str) -> str:
    """What field ``name`` of ``cls`` accepts, in words: "an integer >= 1", "one of hf, vllm, http"."""
    base, info = _declared(cls)[name]
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "allowed" in extra:
        text = extra["allowed"]
        return text() if callable(text) else str(text)
    kind, optional = _without_none(base)
    if typing.get_origin(kind) is Literal:
        return one_of(typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return "one value per use; repeatable"
    words = {int: "an integer", float: "a number", bool: "on or off", str: "text"}.get(kind, str(kind))
    bounds = _bounds(info)
    return f"{words} {bounds}".strip() + (" (or unset)" if optional and kind is not str else "")


def build_parser(cls, prog: str, description: str, *, skip: tuple[str, ...] = (),
                 positionals: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """An argparse parser with one option per field of ``cls`` (``--field-name``; bools get ``--no-...``).

    Values stay text here: :func:`validate` converts and checks them, so flags and config keys get the
    same messages. Options not given on the command line are left out of the namespace (the
    dataclass default applies)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for name, (base, info) in _declared(cls).items():
        if name in skip:
            continue
        field = defaults[name]
        default = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
        shown = "none" if default is None or default == [] else str(default).lower() if isinstance(default, bool) \
            else default
        help_text = f"{info.description or ''} [{allowed(cls, name)}; default: {shown}]".strip()
        help_text = help_text.replace("%", "%%")
        if name in positionals:
            parser.add_argument(name, help=help_text)
            continue
        kind, _ = _without_none(base)
        if kind is bool:
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag(name), action="append", default=argparse.SUPPRESS, metavar=name.upper(),
                                help=help_text)
        else:
            parser.add_argument(flag(name), default=argparse.SUPPRESS, metavar=name.upper(), help=help_text)
    return parser


_ADAPTERS: dict[type, TypeAdapter] = {}


def validate(cls, values: dict[str, Any], *, keys: bool = False):
    """``cls(**values)`` after checking every value against its declaration.

    ``keys=False`` names options as flags (``--max-turns``), ``keys=True`` as config-file keys
    (``max_turns``). Raises :class:`UsageError` (one line) on an unknown name or a bad value."""
    name_of = (lambda n: n) if keys else flag
    known = {f.name for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise UsageError(f"unknown {'key' if keys else 'option'} {name_of(name)}"
                             f"{closest(name_of(name), [name_of(k) for k in known])}")
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    try:
        return _ADAPTERS[cls].validate_python(values)
    except ValidationError as error:
        problem = error.errors(include_url=False)[0]
        name = str(problem["loc"][0]) if problem["loc"] else "?"
        value = problem.get("input")
        if isinstance(value, list):
            value = " ".join(map(str, value))
        where = f"{name_of(name)} {value}" if value not in (None, "") else f"{name_of(name)} (empty)"
        if problem["type"] == "value_error":
            reason = str(problem["ctx"]["error"]) if "ctx" in problem else problem["msg"]
        elif name in known:
            reason = f"must be {allowed(cls, name)}"
        else:
            reason = problem["msg"][:1].lower() + problem["msg"][1:]
        raise UsageError(f"{where}: {reason}") from None


# --- value checks shared by commands (pydantic AfterValidators: return the value or raise ValueError) ---

def task_names() -> str:
    from agent_loop.tasks import TASKS

    return one_of(sorted(TASKS))


def check_task(name: str) -> str:
    """A registered task name, or a plug-in (``package.module:Name``, ``file.py[:Name]``: loaded later)."""
    from agent_loop.tasks import TASKS

    if ":" in name or name.endswith(".py"):
        return name
    if name not in TASKS:
        raise ValueError(f"unknown task{closest(name, TASKS)} (choose {task_names()})")
    return name


def _estimators(per_row: bool) -> list[str]:
    """Registered advantage estimators (``advantages.ESTIMATORS``; imports torch when called). ``per_row``:
    only those a file of rollouts can show alone, needing no group ids and no critic values."""
    from advantages import ESTIMATORS

    return sorted(n for n, e in ESTIMATORS.items() if not per_row or not (e.needs_index or e.needs_values))


def estimator_names(per_row: bool = False) -> str:
    return one_of(_estimators(per_row))


def check_estimator(name: str, per_row: bool = False) -> str:
    """A name in advantages' registry (``per_row``: one that needs neither group ids nor critic values)."""
    names = _estimators(per_row)
    if name in names:
        return name
    if name in _estimators(per_row=False):
        raise ValueError(f"needs group ids or critic values, which a file of rollouts lacks (choose {one_of(names)})")
    raise ValueError(f"unknown advantage estimator{closest(name, names)} (choose {one_of(names)})")


def check_row_estimator(name: str) -> str:
    return check_estimator(name, per_row=True)


def row_estimator_names() -> str:
    return estimator_names(per_row=True)


def int_at_least(low: int):
    """An argparse ``type=`` for parsers not built from a dataclass: an integer >= ``low``, else argparse's
    usage error (exit 2) saying so."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text}: must be an integer >= {low}")
        return value

    convert.__name__ = f"integer >= {low}"
    return convert
