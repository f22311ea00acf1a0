"""How options are declared: once, as fields of a dataclass, for code, flags and config files alike.

Each option is ``name: Annotated[type, Field(constraints, description=help)] = default`` (pydantic's
``Field``: ``ge``/``gt``/``le``/``lt``, ``Literal[...]`` for a fixed set of choices, ``AfterValidator``
for a check of its own that raises ``ValueError("what is wrong; what is allowed")``). The declarations
live with what they configure: the loop's in :class:`agent_loop.episode.loop_config.LoopConfig`, the task's
in :class:`agent_loop.tasks.registry.TaskOptions`, the run's in :class:`agent_loop.runners.spec.RunOptions`;
a command's options are a dataclass that inherits the ones it takes (``agent_loop.cli.rollout``,
``agent_loop.recipes.train_options``). Rules that tie options together are a ``check()`` method raising
:class:`OptionError`. :func:`build` checks values against both; ``agent_loop.cli.flags`` turns a
declaration into flags, config-file keys, help and one-line usage errors. Building a dataclass in code
does not validate; :func:`checked` does.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass
from typing import Annotated

from pydantic import ConfigDict, Field, TypeAdapter

STRICT_NUMBERS = ConfigDict(allow_inf_nan=False)  # a declaration's __pydantic_config__: no nan/inf values


def integer(text: str, low: int = 1):
    """The declaration of a whole-number option of at least ``low`` with help ``text``."""
    return Annotated[int, Field(ge=low, description=text)]


def number(text: str, **bounds):
    """The declaration of a real-number option with help ``text`` and pydantic bounds (``gt=0``, ``le=1``)."""
    return Annotated[float, Field(description=text, **bounds)]


def one_of(choices) -> str:
    """``"one of a, b, c"``: how a declaration's help and errors name a fixed set of choices."""
    return "one of " + ", ".join(str(c) for c in choices)


def closest(name: str, choices) -> str:
    """``"; did you mean X?"`` for the nearest of ``choices``, or ``""``."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else ""


def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 turn"``, ``"2 turns"``, ``"0 errors"``; ``many``: an irregular plural (``plural(n, "entry", "entries")``).
    Every message that counts things says it this way."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def rate(value: float) -> str:
    """A rate between 0 and 1 (success, well-formed calls) as every view writes it: ``0.667``, three decimals,
    never a percentage (issue 49: the two-run table said 67% where the rest said 0.667)."""
    return f"{value:.3f}"


class OptionError(ValueError):
    """A rule across options is broken: ``option`` (a field name) and what is wrong with its value.

    ``message`` may name other options as ``{name}``; :meth:`render` writes every name as a flag
    (``--group-size``) or as a config key (``group_size``, which ``str()`` gives).
    """

    def __init__(self, option: str | None, message: str, value=None):
        self.option, self.message, self.value = option, message, value
        super().__init__(self.render(lambda name: name))

    def render(self, name_of) -> str:
        """The message with every option named by ``name_of`` (``option value: message``; just the message
        when ``option`` is None, for rules that name their options in it)."""
        text = self.message.format_map(_Names(name_of))
        if self.option is None:
            return text
        return f"{name_of(self.option)}{'' if self.value is None else f' {self.value}'}: {text}"


class _Names(dict):
    def __init__(self, name_of):
        super().__init__()
        self.name_of = name_of

    def __missing__(self, key: str) -> str:
        return self.name_of(key)


def _declared_default(cls, name: str):
    """The default of option ``name`` as the first dataclass among ``cls``'s bases declares it."""
    for base in cls.__mro__:
        fields = {f.name: f for f in dataclasses.fields(base)} if dataclasses.is_dataclass(base) else {}
        if name in fields:
            f = fields[name]
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return None


def override_defaults(why: str | dict[str, str] = "", **defaults):
    """Class decorator: make ``cls`` a dataclass whose inherited fields ``defaults`` get other defaults,
    keeping their declaration (type, constraint, help). The one place a command says where its defaults differ;
    ``why``: the reason, which the command's help shows beside each of these defaults (a mapping: one reason per
    option, for options changed for different reasons)."""
    reasons = dict(why) if isinstance(why, dict) else dict.fromkeys(defaults, why)
    if set(reasons) != set(defaults):
        raise TypeError(f"override_defaults: reasons for {sorted(reasons)}, defaults for {sorted(defaults)}")

    def apply(cls):
        hints = typing.get_type_hints(cls, include_extras=True)
        own = dict(cls.__dict__.get("__annotations__", {}))
        declared = {}
        for name, value in defaults.items():
            if name not in hints:
                raise TypeError(f"{cls.__name__} inherits no option {name!r}")
            declared[name] = _declared_default(cls, name)
            own.setdefault(name, hints[name])
            setattr(cls, name, value)
        cls.__annotations__ = own
        cls.__overridden_defaults__ = {**getattr(cls, "__overridden_defaults__", {}), **reasons}
        cls.__declared_defaults__ = {**getattr(cls, "__declared_defaults__", {}), **declared}
        return dataclasses.dataclass(cls)

    return apply


@dataclass
class ProgressOptions:
    """Whether a command draws progress bars and shows the libraries' own logs: with ``--threads``, options every
    command takes (issue 49; ``agent_loop.cli.flags.CommonOptions``)."""

    progress: Annotated[bool, Field(description="progress bars on stderr (--no-progress: none, e.g. for logs); "
                                    "every command takes it, those that draw no bar too")] = True
    verbose: Annotated[bool, Field(description="the libraries' own logs on the terminal too: a vLLM engine's "
                                   "(by default in a file beside the run's output, which its ready line names; a "
                                   "VLLM_LOGGING_LEVEL you set shows them too)")] = False


def is_composed(cls) -> bool:
    """Whether ``cls`` is a composed options class: a dataclass whose every field is a declared options dataclass
    (a sub-config, e.g. ``TrainConfig.update``), rather than an option."""
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    hints = typing.get_type_hints(cls) if fields else {}
    return bool(fields) and all(dataclasses.is_dataclass(hints[f.name]) for f in fields)


def _sub_configs(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def options_view(cls) -> type:
    """The flat declaration of options class ``cls``: itself, or for a composed class one dataclass holding
    every field of its sub-configs (names unique across them) with their declarations, defaults and the reasons
    for changed defaults; the flags, config-file keys and checks of the values read it."""
    if not is_composed(cls):
        return cls
    fields, reasons, declared_defaults = [], {}, {}
    for sub in _sub_configs(cls).values():
        hints = typing.get_type_hints(sub, include_extras=True)
        for f in dataclasses.fields(sub):
            if any(f.name == name for name, _, _ in fields):
                raise TypeError(f"{cls.__name__}: option {f.name!r} is declared by two of its sub-configs")
            default = (dataclasses.field(default_factory=f.default_factory) if f.default is dataclasses.MISSING
                       else dataclasses.field(default=f.default))
            fields.append((f.name, hints[f.name], default))
        reasons.update(getattr(sub, "__overridden_defaults__", {}))
        declared_defaults.update(getattr(sub, "__declared_defaults__", {}))
    namespace = {"__overridden_defaults__": reasons, "__declared_defaults__": declared_defaults,
                 "__doc__": f"The flat options of {cls.__name__} (flags and config-file keys)."}
    if any(getattr(sub, "__pydantic_config__", None) for sub in _sub_configs(cls).values()):
        namespace["__pydantic_config__"] = STRICT_NUMBERS
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields, namespace=namespace)


def compose(cls, values: dict):
    """A composed options class ``cls`` from flat ``values`` (option -> value, as flags and config files give
    them): each sub-config built from its own options; unset ones keep their defaults. A name no sub-config
    declares is a TypeError naming it."""
    groups = _sub_configs(cls)
    known = {f.name: group for group, sub in groups.items() for f in dataclasses.fields(sub)}
    if unknown := sorted(set(values) - set(known)):
        raise TypeError(f"{cls.__name__} has no option {', '.join(unknown)}")
    return cls(**{group: sub(**{name: value for name, value in values.items() if known[name] == group})
                  for group, sub in groups.items()})


def flatten(options) -> dict:
    """The options of ``options`` as one flat mapping (option -> value): a composed options object's sub-configs'
    fields, or a plain options object's own."""
    if not is_composed(type(options)):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return {name: value for group in dataclasses.fields(options) for name, value in flatten(getattr(options, group.name)).items()}


def pick(cls, source) -> dict:
    """The values of ``cls``'s fields found on ``source`` (an options object that inherits them)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if hasattr(source, f.name)}


_ADAPTERS: dict[type, TypeAdapter] = {}


def build(cls, values: dict):
    """``cls`` from ``values``, checked: every value against its declaration (pydantic's ValidationError),
    then the rules across options (``cls.check()``: OptionError). Both are ValueErrors."""
    view = options_view(cls)  # a composed class: its sub-configs' options, checked flat, then composed
    if view not in _ADAPTERS:
        _ADAPTERS[view] = TypeAdapter(view)
    options = _ADAPTERS[view].validate_python(values)
    if view is not cls:
        options = compose(cls, flatten(options))
    if hasattr(options, "check"):
        options.check()
    return options


def checked(options):
    """``options`` (a declared dataclass built in code) checked as :func:`build` checks values: a new instance."""
    if is_composed(type(options)):
        return build(type(options), flatten(options))
    return build(type(options), pick(type(options), options))
