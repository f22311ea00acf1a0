"""Declared options (``agent_loop.options``) as command-line flags, config-file keys, help and usage errors.

From a command's options dataclass:

- :func:`add_options` adds one flag per field to a parser (``--field-name``; bools get ``--no-...``;
  lists are repeatable), with help naming each option's allowed values and default, and ``--config``;
  an option of an earlier version (``agent_loop.cli.config_file.REPLACED``) is refused, naming its replacement;
- :func:`resolve` reads the ``--config`` file (``agent_loop.cli.config_file``), puts the flags given on
  the command line over it, and :func:`validate` checks the result: every value against its
  declaration (pydantic), then the rules across options (the dataclass's ``check()``). The first
  problem is one :class:`UsageError` line naming the option, its value and what is allowed; the CLI
  prints it and exits with status 2, before any model, engine, server or file is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from agent_loop.cli.config_file import REPLACED, ConfigError, read_config, replaced
from agent_loop.options import OptionError, ProgressOptions, build, closest, one_of, options_view
from agent_loop.threads import ThreadOptions

USAGE_EXIT = 2  # exit status of a usage error (argparse's too)
_CONTROL = ("config", "run", "command", "prog", "argv")  # namespace entries that are not options


class UsageError(ValueError):
    """A bad option or config value: one line naming the option, its value and what is allowed."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def _declared(cls) -> dict[str, tuple[Any, FieldInfo]]:
    """field name -> (base type, pydantic FieldInfo merged from the Annotated metadata); once per class."""
    hints = typing.get_type_hints(cls, include_extras=True)
    declared = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        base, *extras = typing.get_args(hint) if typing.get_origin(hint) is typing.Annotated else (hint,)
        infos = [e for e in extras if isinstance(e, FieldInfo)]
        declared[field.name] = (base, FieldInfo.merge_field_infos(*infos) if infos else FieldInfo())
    return declared


def _without_none(kind):
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0], True
    return kind, False


def _takes_bool(kind) -> bool:
    """Whether a declared type takes True/False: ``bool``, or a union holding it (``bool | str | None``)."""
    return kind is bool or bool in typing.get_args(kind)


def _bounds(info: FieldInfo) -> str:
    words = {annotated_types.Ge: (">=", "ge"), annotated_types.Gt: (">", "gt"),
             annotated_types.Le: ("<=", "le"), annotated_types.Lt: ("<", "lt")}
    found = {type(m): f"{words[type(m)][0]} {getattr(m, words[type(m)][1])}" for m in info.metadata if type(m) in words}
    low = found.get(annotated_types.Ge) or found.get(annotated_types.Gt)
    high = found.get(annotated_types.Le) or found.get(annotated_types.Lt)
    return " and ".join(b for b in (low, high) if b)


def _extra(info: FieldInfo) -> dict:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def allowed(cls, name: str) -> str:
    """What field ``name`` of ``cls`` accepts, in words: "an integer >= 1", "one of hf, vllm, http"."""
    base, info = _declared(cls)[name]
    if "allowed" in _extra(info):
        text = _extra(info)["allowed"]
        return text() if callable(text) else str(text)
    kind, optional = _without_none(base)
    if typing.get_origin(kind) is Literal:
        return one_of(typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return "one value per use; repeatable"
    words = {int: "an integer", float: "a number", bool: "on or off", str: "text"}.get(kind, str(kind))
    return f"{words} {_bounds(info)}".strip() + (" (or unset)" if optional and kind is not str else "")


class _Later:
    """Help text computed when help is shown (a choice list that imports torch: not on every start)."""

    def __init__(self, text):
        self.text = text

    def __str__(self) -> str:
        return self.text()


def _allowed_help(cls, name: str):
    """``allowed(cls, name)`` now, or as a ``%(allowed)s`` that argparse fills when it prints help."""
    text = _extra(_declared(cls)[name][1]).get("allowed")
    return ("%(allowed)s", _Later(lambda: allowed(cls, name))) if callable(text) else (allowed(cls, name), None)


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else None


def _inherited_default(cls, name: str):
    """The default of ``name`` as declared before an ``override_defaults`` changed it."""
    if name in getattr(cls, "__declared_defaults__", {}):
        return cls.__declared_defaults__[name]
    for base in cls.__mro__[1:]:
        declared = {f.name: f for f in dataclasses.fields(base)} if dataclasses.is_dataclass(base) else {}
        if name in declared:
            return _default(declared[name])
    return None


def _help(cls, name: str, default) -> tuple[str, _Later | None]:
    """The flag's help: its description, what it allows and its default (and why a command changed it)."""
    info = _declared(cls)[name][1]
    shown = "none" if default in (None, []) else str(default).lower() if isinstance(default, bool) else default
    why = getattr(cls, "__overridden_defaults__", {}).get(name)
    if why:
        shown = f"{shown} (declared default: {_inherited_default(cls, name)}); {why}"
    choices, later = _allowed_help(cls, name)
    text = f"{info.description or ''}".replace("%", "%%")
    return f"{text} [{choices}; default: {str(shown).replace('%', '%%')}]".strip(), later


def _add_flag(parser: argparse.ArgumentParser, cls, name: str, default) -> argparse.Action:
    base, info = _declared(cls)[name]
    help_text, later = _help(cls, name, default)
    kind, _ = _without_none(base)
    if kind is bool:
        action = parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                     help=help_text)
    elif typing.get_origin(kind) is list and _extra(info).get("nargs"):
        action = parser.add_argument(flag(name), nargs=_extra(info)["nargs"], default=argparse.SUPPRESS,
                                     metavar=name.upper(), help=help_text)
    elif typing.get_origin(kind) is list:
        action = parser.add_argument(flag(name), action="append", default=argparse.SUPPRESS, metavar=name.upper(),
                                     help=help_text)
    elif _extra(info).get("nargs") == "?":  # a flag alone (True) or with a value (--resume [FOLDER])
        action = parser.add_argument(flag(name), nargs="?", const=True, default=argparse.SUPPRESS,
                                     metavar=_extra(info).get("metavar", name.upper()), help=help_text)
    else:
        action = parser.add_argument(flag(name), default=argparse.SUPPRESS, metavar=name.upper(), help=help_text)
    if later is not None:
        action.allowed = later  # argparse's help fills %(allowed)s from the action's attributes
    return action


def add_options(parser: argparse.ArgumentParser, cls, *, config_file: bool = True) -> argparse.ArgumentParser:
    """One flag per field of ``cls``, and ``--config`` (unless ``config_file=False``). Values
    stay text here: :func:`validate` converts and checks them, so flags and config keys get the same messages.
    Flags not given are left out of the namespace (the file's value, else the declared default, applies)."""
    cls = options_view(cls)  # a composed class (TrainConfig): its sub-configs' options, one flag each
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in _declared(cls):
        _add_flag(parser, cls, name, _default(fields[name]))
    for old, (new, _) in REPLACED.items():  # taken only to be refused by validate, naming the new option
        if new in fields:
            parser.add_argument(flag(old), nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if config_file:
        parser.add_argument("--config", default=None, metavar="RUN.YAML",
                            help="YAML file of options (keys as option names); flags given here override it")
    return parser


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (a namespace of :func:`add_options`'s parser)."""
    return {name: value for name, value in vars(args).items() if name not in _CONTROL}


def resolve(cls, args: argparse.Namespace):
    """The options of ``args``: its ``--config`` file's settings, the flags given over them, validated."""
    values = {}
    if getattr(args, "config", None):
        try:
            values = read_config(args.config, cls)
        except ConfigError as error:
            raise UsageError(str(error)) from None
    options = validate(cls, {**values, **given(args)})
    if getattr(options, "progress", True) is False:
        quiet_progress()
    return options


def quiet_progress() -> None:
    """``--no-progress``: no bar at all, the libraries' loading bars too (transformers', huggingface_hub's), from
    now on in this process and its children."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub / transformers are imported
    if "transformers" in sys.modules:
        from transformers.utils import logging  # only once loaded: else the variable above does it

        logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars  # as transformers

        disable_progress_bars()


def validate(cls, values: dict[str, Any], *, keys: bool = False):
    """``cls(**values)`` after checking every value against its declaration and the rules across options
    (``cls.check()``, when it has one). ``keys=False`` names options as flags (``--max-turns``),
    ``keys=True`` as config-file keys (``max_turns``). Raises :class:`UsageError` (one line)."""
    name_of = (lambda n: n) if keys else flag
    view = options_view(cls)
    declared = _declared(view)
    for name, value in values.items():
        if (error := replaced(name, declared)) is not None:
            raise UsageError(error.render(name_of))
        if name not in declared:
            kind = "key" if keys else "option"
            raise UsageError(f"unknown {kind} {name_of(name)}{closest(name_of(name), [name_of(k) for k in declared])}")
        if isinstance(value, bool) and not _takes_bool(declared[name][0]):  # pydantic takes True as 1
            raise UsageError(f"{name_of(name)} {value}: must be {allowed(view, name)}")
    try:
        return build(cls, values)
    except ValidationError as error:
        raise UsageError(_problem(view, error, name_of)) from None
    except OptionError as error:
        raise UsageError(error.render(name_of)) from None


def _problem(cls, error: ValidationError, name_of) -> str:
    """The first problem pydantic found, as ``--option value: what is allowed``."""
    problem = error.errors(include_url=False)[0]
    if isinstance(cause := problem.get("ctx", {}).get("error"), OptionError):  # a rule of __post_init__
        return cause.render(name_of)
    name = str(problem["loc"][0]) if problem["loc"] else "?"
    value = problem.get("input")
    if isinstance(value, list):
        value = " ".join(map(str, value))
    where = f"{name_of(name)} {value}" if value not in (None, "") else f"{name_of(name)} (empty)"
    if problem["type"] == "value_error":
        reason = str(problem["ctx"]["error"]) if "ctx" in problem else problem["msg"]
    elif name in {f.name for f in dataclasses.fields(cls)}:
        reason = f"must be {allowed(cls, name)}"
    else:
        reason = problem["msg"][:1].lower() + problem["msg"][1:]
    return f"{where}: {reason}"


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


def number_in(*, gt: float | None = None, ge: float | None = None, le: float | None = None, lt: float | None = None):
    """An argparse ``type=`` for parsers not built from a dataclass: a number within the bounds (pydantic's
    names), else argparse's usage error (exit 2) in the words of a declared field's ("must be a number >= 0 and
    <= 1"). NaN is outside any bound."""
    bounds = [(word, bound, test) for word, bound, test in
              ((">", gt, float.__gt__), (">=", ge, float.__ge__), ("<=", le, float.__le__), ("<", lt, float.__lt__))
              if bound is not None]
    words = " and ".join(f"{word} {bound:g}" for word, bound, _ in bounds)

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not all(test(value, float(bound)) for _, bound, test in bounds):
            raise argparse.ArgumentTypeError(f"{text}: must be a number {words}".rstrip())
        return value

    convert.__name__ = f"number {words}".rstrip()
    return convert


@dataclasses.dataclass
class CommonOptions(ThreadOptions, ProgressOptions):
    """The options every command takes (issue 49): ``--threads`` and ``--progress/--no-progress``. The commands
    built from an options dataclass inherit both groups; the others add them with :func:`add_common_options`."""


def add_common_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """:class:`CommonOptions`' flags for a command whose parser is not built from an options dataclass (serve,
    inspect, tiny, proxy, models, verl-check)."""
    return add_options(parser, CommonOptions, config_file=False)



def threads_from(args: argparse.Namespace) -> int | None:
    """The checked ``--threads`` of such a parser (None: unset); UsageError for a bad value. Its ``--no-progress``
    quiets the libraries' bars (:func:`quiet_progress`)."""
    if getattr(args, "progress", True) is False:
        quiet_progress()
    return validate(ThreadOptions, {"threads": args.threads} if getattr(args, "threads", None) is not None else {}).threads
