"""What a run of rollouts is, whichever runner plays it: the one run specification, the options every
command that plays episodes shares, and the estimator choices both commands check (``train``: any
registered one; ``rollout``: those a file of rollouts can show alone)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

from pydantic import Field

from agent_loop.config import closest, one_of
from agent_loop.episode.config import LoopConfig
from agent_loop.tasks.base import Task, as_task


@dataclass
class RunSpec:
    """Episodes ``episodes`` (indices) of ``task``, played with ``tokenizer``'s chat template under ``config``
    and ``seed``; each finished one written to ``output_path`` (``output_mode``: "new" refuses an existing
    non-empty file, "append"/"resume" add to it; ``agent_loop.runners.jsonl``) with a progress bar.
    ``info``: what every episode of the run records in its ``info`` besides the loop's own fields (:func:`made_with`:
    the gamma and estimator its values are computed with, the resolved options); the runners add ``config``
    there as ``options`` whatever ``info`` holds."""

    task: Task
    tokenizer: Any
    episodes: Iterable[int]
    config: LoopConfig = field(default_factory=LoopConfig)
    seed: int = 0
    output_path: str | Path | None = None
    output_mode: str = "new"
    progress: bool = True
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        self.task = as_task(self.task)
        self.config = self.config or LoopConfig()

    def recorded(self) -> dict:
        """The keys each episode of this run gets in its ``info``: ``info``, with the loop options (``config``)
        under ``options`` (beside any options ``info`` already holds)."""
        return {**self.info, "options": {**dataclasses.asdict(self.config), **self.info.get("options", {})}}


def made_with(gamma: float | None = None, estimator: str | None = None, options: dict | None = None,
              **hyperparameters) -> dict:
    """How a file of rollouts was made, as the keys every episode records in its ``info`` (one way for
    ``agent-loop rollout``'s files and the trainer's step files; ``agent-loop inspect`` reads them):
    ``gamma`` and ``estimator`` (what its returns and advantages are, or were, computed with), the
    estimator's ``hyperparameters`` (``lam``, ``kl_coef``, ...) and ``options`` (the resolved options the
    episodes were played with). Unset (None) values are left out; the loop records ``model_path`` itself."""
    made = {"gamma": None if gamma is None else float(gamma), "estimator": estimator, **hyperparameters}
    if options:
        made["options"] = dict(options)
    return {key: value for key, value in made.items() if value is not None}


@dataclass
class ModelOptions:
    """The model and the seed: what every command that plays or trains on a task takes (declared once)."""

    model: Annotated[str | None, Field(description="local model folder (config.json, tokenizer, chat template); "
                                       "unset: the built-in tiny agent",
                                       json_schema_extra={"allowed": "a folder"})] = None
    seed: Annotated[int, Field(ge=0, description="seed of the questions and of each request's sampling")] = 0


@dataclass
class RunOptions(ModelOptions):
    """The options every command that plays episodes shares (declared once; ``agent_loop.config``)."""

    concurrency: Annotated[int, Field(ge=1, description="episodes in flight at once (the transformers backend "
                                      "decodes them as one batch)")] = 16
    gamma: Annotated[float, Field(ge=0, le=1, description="discount of the returns")] = 1.0


def estimators(per_row: bool = False) -> list[str]:
    """The registered advantage estimators (``advantages.ESTIMATORS``; imports torch when called). ``per_row``:
    only those a file of rollouts can show alone, needing no group ids and no critic values."""
    from advantages import ESTIMATORS

    return sorted(n for n, e in ESTIMATORS.items() if not per_row or not (e.needs_index or e.needs_values))


def estimator_names() -> str:
    return one_of(estimators())


def row_estimator_names() -> str:
    return one_of(estimators(per_row=True))


def check_estimator(name: str, per_row: bool = False) -> str:
    """A name in advantages' registry (``per_row``: one that needs neither group ids nor critic values);
    ValueError saying what is allowed."""
    names = estimators(per_row)
    if name in names:
        return name
    if name in estimators():
        raise ValueError(f"needs group ids or critic values, which a file of rollouts lacks (choose {one_of(names)})")
    raise ValueError(f"unknown advantage estimator{closest(name, names)} (choose {one_of(names)})")


def check_row_estimator(name: str) -> str:
    return check_estimator(name, per_row=True)
