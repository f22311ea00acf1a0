"""reasoning-gym datasets as tasks: ``--task reasoning_gym:NAME`` (docs/ecosystem.md).

Episode ``i`` is the dataset's entry ``i`` (so N episodes cover N entries; an index past ``size`` is refused),
its question the user message after reasoning-gym's own system prompt (which asks for ``<answer>`` tags).
The reward is the dataset's own ``score_answer`` on the final answer: the text inside the last
``<answer>...</answer>`` of the last assistant message (reasoning-gym's ``extract_answer``; ``answer="text"``
scores the whole message instead), or nothing (score of ``None``) when the last message still calls a tool.

Task options (``--task-options`` or the ``task_options`` YAML mapping): ``size`` (entries, default 500),
``seed`` (which entries, default 0), ``calculator`` (true: the built-in calculator tool), ``system`` (the
system prompt; "" for none), ``answer`` (``tag`` or ``text``); any other key is the generator's own config
(``min_terms``, ...). ``NAME`` ``composite`` takes ``datasets``: a list of ``{name, weight, config}``.
"""

from __future__ import annotations

import dataclasses

import reasoning_gym
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from agent_loop.episode.contracts import Task
from agent_loop.options import closest
from agent_loop.tasks import builtin
from agent_loop.tasks.rewards import final_answer
from agent_loop.types import Episode, ToolCallRecord

NEEDS_PROMPTS = False
ANSWER_MODES = ("tag", "text")


def names() -> list[str]:
    return sorted(DATASETS)


class ReasoningGymTask(Task):
    """The reasoning-gym dataset ``dataset`` (its entries, question and scorer) as a task (see the module docstring)."""

    def __init__(self, dataset: str, *, size: int = 500, seed: int = 0, calculator: bool = False,
                 system: str | None = None, answer: str = "tag", **config):
        if dataset not in DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}{closest(dataset, DATASETS)} "
                             f"({len(DATASETS)} datasets: reasoning_gym.factory.DATASETS)")
        if answer not in ANSWER_MODES:
            raise ValueError(f"reasoning_gym:{dataset}: answer={answer!r}: must be one of {', '.join(ANSWER_MODES)}")
        if dataset == "composite" and "datasets" in config:
            config["datasets"] = [_spec(d) for d in config["datasets"]]
        allowed = {f.name for f in dataclasses.fields(DATASETS[dataset][1])} - {"size", "seed"}
        if bad := sorted(set(config) - allowed):
            raise ValueError(f"reasoning_gym:{dataset}: no option {bad[0]!r}; its generator takes "
                             f"{', '.join(sorted(allowed)) or 'none'} (and size, seed, calculator, system, answer)")
        try:
            self.dataset = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
        except Exception as error:  # the generator's own checks (AssertionError, ValueError, ...)
            raise ValueError(f"reasoning_gym:{dataset}: the generator refused its options: "
                             f"{type(error).__name__}: {error}") from None
        self.name = f"reasoning_gym:{dataset}"
        self.size, self.answer_mode = size, answer
        self.system = SYSTEM_PROMPTS["default"] if system is None else system
        self.tools = [builtin.calculator] if calculator else []

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        if not 0 <= index < self.size:
            raise ValueError(f"{self.name}: episode index {index} is past the dataset's {self.size} entries "
                             "(task option size)")
        entry = self.dataset[index]
        messages = [{"role": "user", "content": entry["question"]}]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        return Episode(messages=messages, tools=list(self.tools), answer=entry["answer"],
                       info={"entry": index, "metadata": entry["metadata"]})

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        text = final_answer(messages, episode.tool_format)
        answer = (extract_answer(text) if self.answer_mode == "tag" else text.strip()) if text else None
        entry = {"question": episode.messages[-1]["content"], "answer": episode.answer,
                 "metadata": episode.info["metadata"]}
        return self.dataset.score_answer(answer, entry)


def _spec(item) -> DatasetSpec:
    """A composite's ``datasets`` entry (a ``{name, weight, config}`` mapping) as reasoning-gym's DatasetSpec."""
    if isinstance(item, DatasetSpec):
        return item
    if not isinstance(item, dict) or "name" not in item:
        raise ValueError(f"reasoning_gym:composite: each of datasets is {{name, weight, config}}, got {item!r}")
    if item["name"] not in DATASETS:
        raise ValueError(f"reasoning_gym:composite: unknown dataset {item['name']!r}{closest(item['name'], DATASETS)}")
    return DatasetSpec(item["name"], float(item.get("weight", 1.0)), dict(item.get("config") or {}))


def load(name: str, *, prompts: str | None = None, options: dict | None = None, system: str | None = None) -> Task:
    """``--task reasoning_gym:NAME`` with its task options (ValueError: one line)."""
    if prompts is not None:
        raise ValueError("reasoning_gym tasks make their own entries: give --task-options size=N, not --prompts")
    options = dict(options or {})
    if system is not None:
        options["system"] = system
    return ReasoningGymTask(name, **options)
