"""What a run of rollouts is, whichever runner plays it: the one run specification, and the options every
command that plays episodes shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

from pydantic import Field

from agent_loop.episode.config import LoopConfig
from agent_loop.tasks.base import Task, as_task


@dataclass
class RunSpec:
    """Episodes ``episodes`` (indices) of ``task``, played with ``tokenizer``'s chat template under ``config``
    and ``seed``; each finished one written to ``output_path`` (``output_mode``: "new" refuses an existing
    non-empty file, "append"/"resume" add to it; ``agent_loop.runners.jsonl``) with a progress bar."""

    task: Task
    tokenizer: Any
    episodes: Iterable[int]
    config: LoopConfig = field(default_factory=LoopConfig)
    seed: int = 0
    output_path: str | Path | None = None
    output_mode: str = "new"
    progress: bool = True

    def __post_init__(self):
        self.task = as_task(self.task)
        self.config = self.config or LoopConfig()


@dataclass
class RunOptions:
    """The options every command that plays episodes shares (declared once; ``agent_loop.config``)."""

    model: Annotated[str | None, Field(description="local model folder (config.json, tokenizer, chat template); "
                                       "unset: the built-in tiny agent",
                                       json_schema_extra={"allowed": "a folder"})] = None
    seed: Annotated[int, Field(ge=0, description="seed of the questions and of each request's sampling")] = 0
    concurrency: Annotated[int, Field(ge=1, description="episodes in flight at once (the transformers backend "
                                      "decodes them as one batch)")] = 16
    gamma: Annotated[float, Field(ge=0, le=1, description="discount of the returns")] = 1.0
