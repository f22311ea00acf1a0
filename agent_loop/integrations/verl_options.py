"""The options of our verl AgentLoop (``agent_loop.integrations.verl_agent_loop``), declared as every option is
(``agent_loop.options``): fields with their checks, the rules across them in ``check()``, built by
:func:`agent_loop.options.build`. The row options (``reward``, ``reward_weights``, ``system``) are the ones
``--prompts`` rows take (:class:`~agent_loop.tasks.registry.DataTaskOptions`); the loop's are
:class:`~agent_loop.episode.loop_config.LoopConfig`'s, under ``loop``.

verl passes them through its own config: the trainer config's top-level ``agent_loop`` section
(``+agent_loop.task=arithmetic``) and, overriding it, the keys of an entry in verl's ``agent_loop_config_path``
file (docs/verl.md, "Our agent loop inside verl"). This module does not import verl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tool_formats import TOOL_FORMATS
from agent_loop.options import OptionError, build, closest, one_of, override_defaults
from agent_loop.tasks.registry import DataTaskOptions, SeedOptions, TaskChoice

REWARD_SOURCES = ("auto", "agent_loop", "verl")
# built once: verl makes one AgentLoop per row, and a TypeAdapter's schema build was a third of our worker's time
# (BENCHMARKS.md, "Our loop against verl's tool_agent")
LOOP_CONFIG = TypeAdapter(LoopConfig)
LOOP_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopConfig))


def _tool_format(name: str | None) -> str | None:
    names = sorted({f.name for f in TOOL_FORMATS})
    if name is not None and name not in names:
        raise ValueError(f"{name!r} is not one of ours{closest(name, names)} ({one_of(names)})")
    return name


def _loop_fields(fields: dict) -> dict:
    """The ``loop`` mapping as given (``loop_config`` fills in verl's budget), checked against LoopConfig."""
    unknown = sorted(set(fields) - LOOP_FIELDS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}{closest(unknown[0], LOOP_FIELDS)}; known: {sorted(LOOP_FIELDS)}")
    try:
        LOOP_CONFIG.validate_python(fields)
    except ValidationError as error:
        problem = error.errors(include_url=False)[0]
        raise ValueError(f"{'.'.join(map(str, problem['loc']))}={problem.get('input')!r}: {problem['msg']}") from None
    if fields.get("context", "keep") != "keep":  # never trained as independent rows (issue 54)
        raise ValueError(f"context={fields['context']!r} splits an episode into segments of one session, and verl's "
                         "AgentLoop returns one row per sample with no session field to join them by: use context 'keep'")
    return dict(fields)


@override_defaults({"task": "verl's: unset, each row is the episode; with a task, a row with verl's "
                            "extra_info.index i plays its episode i, with the row's reward_model.ground_truth as the "
                            "answer where the task gives none"}, task=None)
class VerlLoopOptions(DataTaskOptions, SeedOptions, TaskChoice):
    """What the verl AgentLoop plays; without a ``task`` each verl row is the episode (its ``raw_prompt``,
    ``reward_model.ground_truth`` as the answer), scored by ``reward``/``reward_weights``, with ``system``. The
    ``task`` and ``seed`` keys are the commands' ``--task`` and ``--seed`` (declared once:
    :class:`~agent_loop.tasks.registry.TaskChoice`, :class:`~agent_loop.tasks.registry.SeedOptions`); ``task``
    is unset here."""

    tool_functions: Annotated[str | None, Field(
        description="a module or .py file of plain functions (our --tools), added to verl's tools and the task's")] = None
    tool_format: Annotated[str | None, AfterValidator(_tool_format), Field(
        description="our tool-call format by name (hermes, qwen3_xml, ...); unset: the one the chat template's "
                    "markers name")] = None
    reward_source: Annotated[Literal[REWARD_SOURCES], Field(
        description="agent_loop: our reward is reward_score (verl's rm_scores on the last response token, instead "
                    "of its reward manager); verl: verl's reward manager scores, ours is kept in agent_loop_reward; "
                    "auto: agent_loop when a task or reward is given")] = "auto"
    loop: Annotated[dict, AfterValidator(_loop_fields), Field(
        description="LoopConfig fields (max_turns, max_tokens, max_observation_tokens, ...); max_response_tokens "
                    "is verl's rollout.response_length")] = field(default_factory=dict)

    def check(self) -> None:
        """The rules across the options (OptionError)."""
        if self.task and self.reward:
            raise OptionError(None, "give either {task} (it brings its reward) or {reward} (for row episodes), not both")
        if self.reward_source == "agent_loop" and not (self.task or self.reward):
            raise OptionError("reward_source", "needs {task} or {reward} to score with", "agent_loop")

    @classmethod
    def from_mapping(cls, values: dict) -> VerlLoopOptions:
        """The options of a verl config mapping; ValueError (one line, naming the key) for an unknown key or a bad
        value. As verl's config writes them, ``reward``/``reward_weights`` may be one value, and null is unset."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"agent_loop options: unknown key(s) {unknown}{closest(unknown[0], known)}; "
                             f"known: {sorted(known)}")
        values = {k: v for k, v in values.items() if v is not None}  # null (an entry's override): the default
        for key in ("reward", "reward_weights"):
            if isinstance(values.get(key), (str, int, float)):
                values[key] = [values[key]]
        try:
            return build(cls, values)
        except ValidationError as error:
            problem = error.errors(include_url=False)[0]
            reason = str(problem["ctx"]["error"]) if problem["type"] == "value_error" else problem["msg"]
            key = ".".join(map(str, problem["loc"][:1]))
            raise ValueError(f"agent_loop.{key}={problem.get('input')!r}: {reason}") from None
        except OptionError as error:
            raise ValueError(error.render(lambda name: f"agent_loop.{name}")) from None

    @property
    def scores(self) -> str:
        """Who scores the rows: "agent_loop" or "verl"."""
        if self.reward_source != "auto":
            return self.reward_source
        return "agent_loop" if (self.task or self.reward) else "verl"

    def loop_config(self, response_length: int) -> LoopConfig:
        """Our loop's options, with verl's ``response_length`` as the episode's token budget."""
        given = self.loop.get("max_response_tokens")
        if given is not None and given > response_length:
            raise ValueError(f"agent_loop.loop.max_response_tokens={given} exceeds verl's rollout.response_length="
                             f"{response_length}")
        return LOOP_CONFIG.validate_python({"max_response_tokens": response_length, **self.loop})
