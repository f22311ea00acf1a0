"""What a run of rollouts is, whichever runner plays it: the one run specification, the options every
command that plays episodes shares, and the estimator choices both commands check (``train``: any
registered one; ``rollout``: those a file of rollouts can show alone), with the estimators' settings
(``--gamma``, ``--lam``, ...) declared from advantages' own declarations (``advantages.settings``)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

from pydantic import AfterValidator, BeforeValidator, Field

from advantages.settings import SETTINGS_CLASSES
from agent_loop.builtin_models import model_option_help
from agent_loop.episode.contracts import Task, as_task
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.options import OptionError, closest, one_of
from agent_loop.tasks.registry import SeedOptions


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
class ModelOptions(SeedOptions):
    """The model and the seed: what every command that plays or trains on a task takes (declared once)."""

    model: Annotated[str | None, Field(description=model_option_help(),
                                       json_schema_extra={"allowed": "a folder or a built-in name"})] = None


@dataclass
class RunOptions(ModelOptions):
    """The options every command that plays episodes shares (declared once; ``agent_loop.options``)."""

    concurrency: Annotated[int, Field(ge=1, description="episodes in flight at once (the transformers backend "
                                      "decodes them as one batch)")] = 16
    group_size: Annotated[int, Field(ge=1, description=(
        "samples per question: episode i plays question i // group_size (info.group); the group estimators "
        "(grpo, rloo, reinforce_plus_plus_baseline and the turn-level ones that compare a group's episodes) "
        "need 2 or more"))] = 1


def estimators(per_row: bool = False) -> list[str]:
    """The registered advantage estimators (``advantages.ESTIMATORS``; imports torch when called). ``per_row``:
    only those a file of rollouts can show, needing no critic values (the group estimators take the group ids
    of ``group_size`` samples per question: :func:`check_group_estimator`)."""
    from advantages import ESTIMATORS  # torch: the options load at the CLI's start without it

    return sorted(n for n, e in ESTIMATORS.items() if not per_row or not e.needs_values)


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
        raise ValueError(f"needs critic values, which a file of rollouts lacks (agent-loop train --estimator {name} "
                         f"trains a critic; choose {one_of(names)})")
    raise ValueError(f"unknown advantage estimator{closest(name, names)} (choose {one_of(names)})")


def check_row_estimator(name: str) -> str:
    return check_estimator(name, per_row=True)


def check_group_estimator(name: str, group_size: int) -> None:
    """OptionError unless ``group_size`` is 2 or more for an estimator that compares a group's samples
    (``needs_index``): with one sample per question it would have no baseline."""
    from advantages import get_estimator  # torch: as estimators()

    if get_estimator(name).needs_index and group_size < 2:
        raise OptionError("estimator", "compares samples of the same question; needs {group_size} 2 or more "
                          f"(got {group_size})", name)


def settings_options(classes=SETTINGS_CLASSES) -> dict[str, tuple[Any, Any]]:
    """Each field of the estimators' settings dataclasses ``classes`` as an option: its name -> ``(Annotated[type,
    Field(description, bounds)], default)``, from the field's type and ``metadata`` (``advantages.settings``); a
    name two classes declare differently is a TypeError."""
    declared: dict[str, tuple[Any, Any, dict]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for setting in dataclasses.fields(cls):
            found = (hints[setting.name], setting.default, dict(setting.metadata))
            if declared.setdefault(setting.name, found) != found:
                raise TypeError(f"the estimators' setting {setting.name} is declared twice, differently ({cls.__name__})")
    return {name: (Annotated[hint, Field(**metadata)], default) for name, (hint, default, metadata) in declared.items()}


def with_settings_options(cls):
    """``cls`` (before ``@dataclass``) with one field per estimator setting (:func:`settings_options`)."""
    for name, (declaration, default) in settings_options().items():
        cls.__annotations__[name] = declaration
        setattr(cls, name, default)
    return cls


@dataclass
@with_settings_options
class EstimatorOptions:
    """The advantage estimator and the settings of every estimator (``gamma``, ``lam``, ``step_advantage_w``,
    ``gigpo_mode``: declared in ``advantages.settings``, fields added by :func:`with_settings_options`): what train
    trains with and rollout's summary table shows (declared once; rollout's ``check()`` takes only those a file of
    rollouts can show, :func:`check_row_estimator`)."""

    estimator: Annotated[str, AfterValidator(check_estimator), Field(
        description="advantage estimator (train: what it trains with; rollout: its summary table, one that needs "
                    "no critic values); the two reinforce_plus_plus_* variants reproduce pre-PR #7300 return bugs: "
                    "ablation only", json_schema_extra={"allowed": estimator_names})] = "reinforce_plus_plus"

    def estimator_settings(self, name: str | None = None):
        """The settings instance of estimator ``name`` (default: ``estimator``) from these options, for its registry
        entry's ``settings=``; None for an estimator without settings (imports torch: ``advantages.get_estimator``)."""
        from advantages import get_estimator  # torch: as estimators()

        settings = get_estimator(name or self.estimator).settings
        if settings is None:
            return None
        return settings(**{setting.name: getattr(self, setting.name) for setting in dataclasses.fields(settings)})

    def made_with(self, options: dict | None = None, **more) -> dict:
        """:func:`made_with` of these options: ``gamma``, ``estimator`` and the estimator's other settings (``lam``,
        ``step_advantage_w``, ``gigpo_mode`` where it takes them), ``options``, and ``more`` (``kl_coef``, ...)."""
        settings = self.estimator_settings()
        own = {} if settings is None else {k: v for k, v in dataclasses.asdict(settings).items() if k != "gamma"}
        return made_with(self.gamma, self.estimator, options, **own, **more)


@dataclass
class EpisodesOptions:
    """How many of the task's episodes a command takes (rollout plays them, warmstart demonstrates them)."""

    episodes: Annotated[int, Field(ge=1, description=(
        "the task's episodes 0 .. N-1 under --seed: rollout plays them; warmstart solves each by the task's "
        "demonstrate(episode, rng) hook and fine-tunes on them (evaluate on another --seed)"))] = 64


def resume_value(value):
    """``--resume`` alone (True), a folder (str), or off: None (a saved config's ``false`` too)."""
    return None if value is None or value is False or value == "" else value


@dataclass
class ResumeOptions:
    """Going on from where a stopped run left off: rollout, train and warmstart (declared once)."""

    resume: Annotated[bool | str | None, BeforeValidator(resume_value), Field(
        description="go on from where a stopped run left off. Alone: from the run's own output (rollout: play only "
                    "the episodes --out lacks, appending them, a torn last line repaired first; train, warmstart: "
                    "the latest complete checkpoint in --output-dir). train and warmstart also take a checkpoint "
                    "folder (OUTPUT_DIR/checkpoints/step_NNNNNN) or a run folder (its latest complete checkpoint)",
        json_schema_extra={"allowed": "alone, or a checkpoint or run folder (train, warmstart)", "nargs": "?",
                           "metavar": "FOLDER"})] = None
    allow_config_change: Annotated[bool, Field(
        description="--resume (rollout: or --append) even when settings that change the run differ from those "
                    "saved (rollout: beside --out; train, warmstart: in the checkpoint); the differences are "
                    "listed")] = False

