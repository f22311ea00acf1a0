"""The one registry of advantage estimators: a name (or :class:`AdvantageEstimator`) -> an entry that
declares what the estimator needs (verl's ``register_adv_est`` / ``get_adv_estimator_fn``, plus needs).

Every estimator is a plain function taking ``token_level_rewards`` and ``response_mask`` ``(b, t)``
(plus ``index`` ``(b,)`` or ``values`` ``(b, t)`` when it needs them) and returning
``(advantages, returns)``. An :class:`Estimator` entry calls it by keyword, so each function keeps
its own positional order (verl's), and passes every other keyword through untouched: a misspelled
or unsupported keyword raises the function's own ``TypeError`` instead of being dropped. An estimator
with settings (``gamma``, ``lam``, ...) registers their dataclass (:mod:`advantages.settings`), and its
entry takes an instance: ``entry(rewards, mask, settings=entry.settings(gamma=0.9), **batch_fields)``.

The built-in estimators register when their modules load (``advantages.estimators``,
``advantages.turn_credit``): the package does that on its first attribute, and :func:`get_estimator` too.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from advantages.sessions import estimate_by_session

BUILT_IN = ("advantages.estimators", "advantages.turn_credit")  # the modules that register the built-in estimators
BATCH_ARGUMENTS = (
    "token_level_rewards", "response_mask", "values", "index", "spans", "validate",
    "turn_ids", "responses", "turn_states",  # the turn-level estimators' (advantages/turn_credit.py)
)


class AdvantageEstimator(str, Enum):
    """Registered names; values equal to verl's ``AdvantageEstimator`` where verl has the estimator."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS_RESET_AT_OBSERVATION = "reinforce_plus_plus_reset_at_observation"
    REINFORCE_PLUS_PLUS_IGNORE_MASK = "reinforce_plus_plus_ignore_mask"
    # turn-level credit (advantages/turn_credit.py, issue 47; advantages.settings.TURN_LEVEL); GIGPO is verl-agent's name
    TURN_RETURNS = "turn_returns"
    TURN_RLOO = "turn_rloo"
    TURN_INDEX_NORMALIZED = "turn_index_normalized"
    GIGPO = "gigpo"
    TURN_GAE = "turn_gae"


@dataclass(frozen=True)
class Estimator:
    """One registry entry: the function and what it needs.

    ``needs_index``: a group id per row (``index`` ``(b,)``: a tensor, numpy array or list of ints
    or strings). ``needs_values``: critic values ``values`` ``(b, t)``. ``settings``: the frozen
    dataclass of its settings (:mod:`advantages.settings`; None: it takes none), whose fields are
    keywords of ``fn``. ``hyperparameters``: every keyword the function takes besides the batch
    (``gamma``, ``lam``, ``whiten``, ``epsilon``, ...), read from its signature.
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    needs_index: bool = False
    needs_values: bool = False
    description: str = ""
    settings: type | None = None

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        return tuple(p for p in inspect.signature(self.fn).parameters if p not in BATCH_ARGUMENTS)

    @property
    def batch_arguments(self) -> tuple[str, ...]:
        """The :data:`BATCH_ARGUMENTS` the function takes (from its signature, in its order), so a
        caller passes exactly the batch fields this estimator uses (``turn_ids``, ``responses``, ..)."""
        return tuple(p for p in inspect.signature(self.fn).parameters if p in BATCH_ARGUMENTS)

    def keywords(self, settings) -> dict:
        """``settings`` as keywords of ``fn``: its fields, when it is an instance of exactly :attr:`settings`
        (TypeError otherwise); ``{}`` for None (the function's own defaults)."""
        if settings is None:
            return {}
        if self.settings is None or type(settings) is not self.settings:
            wanted = "takes no settings" if self.settings is None else f"takes {self.settings.__name__}"
            raise TypeError(f"the {self.name} estimator {wanted}, got {type(settings).__name__}")
        return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}

    def __call__(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, settings=None, session=None,
                 segment=None, **kwargs):
        """``fn(token_level_rewards=..., response_mask=..., **settings' fields, **kwargs)`` after checking the needs.

        ``settings``: an instance of :attr:`settings` (:meth:`keywords`), or None for the function's own
        defaults; a keyword given both there and in ``kwargs`` is a TypeError. ``kwargs``: the batch fields
        (:attr:`batch_arguments`) and any other keyword of ``fn`` (``whiten``, ``validate``, ...).

        Sessions (docs/design.md section 3, "Sessions"): with ``session`` and ``segment`` (``(b,)`` each:
        ``Batch.session`` and ``Batch.segment`` from ``collate(sessions=..., segments=...)``), the rows
        are segments of sessions and ``fn`` runs on the sessions, each joined into one row
        (:func:`advantages.sessions.estimate_by_session`; ``spans`` is then required); the outputs are
        ``(b, t)`` as always. ``session=None`` (the default): every row is its own episode, bit-exact
        the call without sessions (on a batch of segments: the row-per-segment ablation, biased).
        """
        for needed, key, what in ((self.needs_index, "index", "index=(b,) group ids"),
                                  (self.needs_values, "values", "values=(b, t) critic values")):
            if needed and kwargs.get(key) is None:
                raise ValueError(f"the {self.name} estimator needs {what}")
        given = self.keywords(settings)
        if twice := sorted(given.keys() & kwargs.keys()):
            raise TypeError(f"the {self.name} estimator got {', '.join(twice)} in settings and as keywords")
        kwargs = {**given, **kwargs}
        if session is None and segment is None:
            return self.fn(token_level_rewards=token_level_rewards, response_mask=response_mask, **kwargs)
        if session is None or segment is None:
            raise ValueError("session and segment come together: (b,) session ids and segment numbers")
        return estimate_by_session(self.fn, token_level_rewards, response_mask, session, segment, kwargs)


ESTIMATORS: dict[str, Estimator] = {}


def _name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(
    name_or_enum: str | Enum, *, needs_index: bool = False, needs_values: bool = False, description: str = "",
    settings: type | None = None,
) -> Callable:
    """Decorator registering an estimator under a name or enum member (verl's ``register_adv_est``), with
    its ``settings`` dataclass (:mod:`advantages.settings`) when it has settings.

    Registering the same function twice is a no-op; another function under a taken name raises
    ValueError (as verl). The decorated function is returned unchanged.
    """
    name = _name(name_or_enum)

    def decorator(fn):
        existing = ESTIMATORS.get(name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered: {existing.fn} vs {fn}")
        ESTIMATORS[name] = Estimator(name, fn, needs_index, needs_values, description or (fn.__doc__ or "").split("\n")[0],
                                     settings)
        return fn

    return decorator


def register_built_in() -> None:
    """Load the modules of the built-in estimators (:data:`BUILT_IN`), which registers them; loaded ones are kept."""
    for module in BUILT_IN:
        importlib.import_module(module)


def get_estimator(name_or_enum: str | Enum) -> Estimator:
    """The registry entry for ``name_or_enum`` (the built-in estimators registered first); ValueError lists the
    registered names."""
    register_built_in()
    name = _name(name_or_enum)
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}") from None


def get_adv_estimator_fn(name_or_enum: str | Enum) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The registered function itself (verl's ``get_adv_estimator_fn``)."""
    return get_estimator(name_or_enum).fn
