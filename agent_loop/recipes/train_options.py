"""``agent-loop train``'s settings: :class:`TrainConfig`, composed of six sub-configs, whose defaults train the built-in
tiny agent on the arithmetic task on 2 CPU cores.

Each sub-config is made of the option groups declared once beside what they configure, with train's own
defaults where it needs others (:func:`~agent_loop.options.override_defaults` says so, and ``--help`` says why):

- ``run``: the model, seed, episodes in flight, samples per question, steps, threads, device, precision,
  processes, LoRA (:class:`TrainRun`);
- ``rollout``: the task, the loop, your own agent, questions per step, asynchronous and filtered steps, the
  held-out evaluation (:class:`TrainRollouts`);
- ``sampler``: where the episodes are sampled: the backend, its precision, the servers (:class:`TrainSampler`);
- ``update``: AdamW and its schedule (``agent_loop.training.run_options``) and the PPO step
  (``agent_loop.training.ppo_options``) (:class:`TrainUpdate`);
- ``advantage``: the advantage estimator and its settings (declared in ``advantages.settings``), the KL penalty
  (:class:`TrainAdvantage`);
- ``output``: the run's folder, checkpoints, reports, resume (:class:`TrainOutput`).

The flags and config-file keys stay flat (``--lr``, ``group_size``): every option's name is unique across the
sub-configs (``agent_loop.options.options_view``). In code: ``TrainConfig.from_flat(lr=1e-4, steps=10)``, or the
sub-configs themselves. Building one does not check it; ``agent_loop.options.checked`` does (the declarations,
then :meth:`TrainConfig.check`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field

from agent_loop.backends.server_options import ServerOptions, server_url
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.options import OptionError, closest, compose, flatten, integer, number, one_of, override_defaults, pick
from agent_loop.proxy import AgentOptions
from agent_loop.runners.backend_choice import AUTO, BackendOptions
from agent_loop.runners.spec import EstimatorOptions, ResumeOptions, RunOptions, check_group_estimator
from agent_loop.tasks.registry import TaskOptions
from agent_loop.threads import ThreadOptions
from agent_loop.training.ppo_options import PPOOptions
from agent_loop.training.run_options import (
    BASE_EPISODES_PER_ADAM_STEP,
    BASE_LR,
    DTYPES,
    DeviceOptions,
    OptimizerOptions,
    OutputOptions,
    StepsOptions,
    run_folder_of,
)

# agent-loop rollout's defaults differ; --help says why beside each
SHORTER_EPISODES = ("train's own, not rollout's (shorter episodes, more at once): the built-in tasks take 2 turns, "
                    "and the tiny agent's RL results (BENCHMARKS.md) were trained and are reproduced with these; "
                    "raise them for longer tasks")


def kl_kinds() -> tuple[str, ...]:
    """The sampled-token modes of ``advantages.kl_penalty`` ("full" needs whole-vocabulary log-probs)."""
    from advantages import KL_PENALTY_MODES  # imports torch: only when the option is checked or its help shown

    return tuple(m for m in KL_PENALTY_MODES if m != "full")


def kl_kind_names() -> str:
    return one_of(kl_kinds())


def check_kl_kind(name: str) -> str:
    if name not in kl_kinds():
        raise ValueError(f"unknown KL estimator{closest(name, kl_kinds())} (choose {one_of(kl_kinds())})")
    return name


@override_defaults({"concurrency": SHORTER_EPISODES,
                    "steps": "train's own: a run of RL steps must be given a length (warmstart's follows its data)"},
                   concurrency=64, steps=150)
class TrainRun(RunOptions, StepsOptions, ThreadOptions, DeviceOptions):
    """What is trained, for how long, where: the model, seed, concurrency, group size, steps, threads, device,
    precision, processes and LoRA."""

    tiny_stage: Annotated[Literal["mid", "final"], Field(
        description="the built-in tiny agent (when --model is unset): mid = a middling warm start for RL, "
                    "final = fully trained")] = "mid"
    dtype: Annotated[Literal[tuple(DTYPES)], Field(
        description="bf16: forward passes under bf16 autocast, fp32 master weights and AdamW state")] = "fp32"
    nproc: integer("data-parallel processes; > 1 relaunches under torchrun (gloo on CPU, NCCL on CUDA)") = 1
    parallel: Annotated[Literal["auto", "ddp", "fsdp"], Field(
        description="data-parallel wrapper with several processes: ddp (DistributedDataParallel, replicas), "
                    "fsdp (FSDP2 fully_shard, sharded; not with LoRA); auto: fsdp on CUDA, ddp on CPU or with LoRA")] = \
        "auto"
    lora_rank: integer("LoRA rank; 0 = train every weight", 0) = 0
    lora_alpha: number("LoRA alpha", gt=0) = 16.0
    lora_target_modules: Annotated[str, Field(
        description='"all-linear" or comma-separated module names, e.g. "q_proj,v_proj"')] = "all-linear"

    def lora(self) -> dict | None:
        """The LoRA settings (``rank``, ``alpha``, ``target_modules``), or None to train every weight."""
        return {"rank": self.lora_rank, "alpha": self.lora_alpha, "target_modules": self.lora_target_modules} \
            if self.lora_rank else None


@override_defaults(SHORTER_EPISODES, max_turns=3, max_tokens=48, max_response_tokens=256)
class TrainRollouts(AgentOptions, LoopConfig, TaskOptions):
    """What a step plays: the task, the loop's options, your own agent, how many questions, asynchronous and
    filtered steps, and the held-out evaluation."""

    prompts_per_step: integer("questions per step") = 64
    max_staleness: integer("asynchronous training: 0 = synchronous steps (play, then train); K >= 1 = a rollout "
                           "producer keeps playing (on the --server(s) or the in-process backend) while the "
                           "trainer trains, episodes in flight take new weights between turns, and a step trains "
                           "only on episodes whose oldest token was sampled at most K steps ago (older ones are "
                           "dropped: episodes/dropped_stale; docs/design.md 8a)", 0) = 0
    filter_groups: Annotated[bool, Field(
        description="dynamic sampling (DAPO's filter_groups): drop the groups whose sessions' raw outcomes (the "
                    "task's success, not the shaped reward) are all equal, and play fresh questions until the step "
                    "holds --prompts-per-step groups, or --filter-groups-max-rounds extra rounds were played "
                    "(metrics filter_groups/*; needs --group-size 2 or more)")] = False
    filter_groups_max_rounds: integer("--filter-groups: the extra rounds (each --prompts-per-step groups) a step may "
                                      "play beyond its first before it trains on the groups it kept "
                                      "(filter_groups/bound_hit 1); 9: verl's max_num_gen_batches 10 in all", 0) = 9
    eval_every: integer("steps between greedy evaluations on held-out questions; 0 = never", 0) = 0
    eval_episodes: integer("held-out questions per evaluation") = 100

    def loop_config(self) -> LoopConfig:
        """The loop's own options of these (a plain :class:`LoopConfig`)."""
        return LoopConfig(**pick(LoopConfig, self))


@dataclass
class TrainSampler(BackendOptions, ServerOptions):
    """Where the episodes play: the backend, its rollout precision, the rollout servers."""


@dataclass
class TrainUpdate(OptimizerOptions, PPOOptions):
    """The update of a step: AdamW and its schedule, the PPO step and its rollout correction."""


@dataclass
class TrainAdvantage(EstimatorOptions):
    """The advantage estimator and its settings, and the KL penalty to the frozen initial policy."""

    kl_coef: number("KL penalty to the frozen initial policy, subtracted from ASSISTANT token rewards; 0 = off",
                     ge=0) = 0.0
    kl_kind: Annotated[str, AfterValidator(check_kl_kind), Field(
        description="KL estimator (a sampled-token mode of advantages.kl_penalty)",
        json_schema_extra={"allowed": kl_kind_names})] = "k1"
    session_credit: Annotated[Literal["session", "segment"], Field(
        description="where an agent or a --context policy rewrote the history (a session of several segments): "
                    "session = one sample per session, its returns running across its segments; segment = each "
                    "segment its own episode carrying the session's reward (the row-per-segment ablation, biased: "
                    "docs/design.md section 3)")] = "session"


@dataclass
class TrainOutput(OutputOptions, ResumeOptions):
    """The run's folder, checkpoints and reports; going on from a checkpoint."""

    DEFAULT_OUTPUT_DIR: ClassVar[str] = "runs/train"  # unset --output-dir: this, or the first free runs/train-N

    tensorboard: Annotated[bool, Field(description="write TensorBoard event files to OUTPUT_DIR/tensorboard")] = True
    wandb_project: Annotated[str | None, Field(description="also log each step to this Weights & Biases project "
                                               "(needs `pip install wandb`; WANDB_MODE=offline works without "
                                               "an account)")] = None
    save_rollouts_every: integer("steps between saved training rollouts (OUTPUT_DIR/rollouts/step_NNNNNN.jsonl, "
                                 "with the returns and advantages each step used); 0 = none", 0) = 1
    keep_checkpoints: integer("checkpoints kept in OUTPUT_DIR/checkpoints, the newest; an older one is removed "
                              "once a newer one is complete (as verl's max_actor_ckpt_to_keep, transformers' "
                              "save_total_limit: SmolLM2's is 1.6 GB with its optimizer state); 0 = all", 0) = 0

    def default_output_dir(self) -> str:
        """The run folder of ``resume`` (a run folder, or the one a checkpoint folder is in), else a fresh one.

        Under torchrun every process must name the same folder, so there it must be given."""
        if self.resume is not None:
            return run_folder_of(self.resume)
        if "WORLD_SIZE" in os.environ:
            raise OptionError("output_dir", "must be given under torchrun (every process writes to one folder)")
        return super().default_output_dir()


@dataclass
class TrainConfig:
    """Everything one training run needs, in six sub-configs (see the module docstring). The CLI exposes every
    option of every sub-config as ``--option-name``."""

    run: TrainRun = field(default_factory=TrainRun)
    rollout: TrainRollouts = field(default_factory=TrainRollouts)
    sampler: TrainSampler = field(default_factory=TrainSampler)
    update: TrainUpdate = field(default_factory=TrainUpdate)
    advantage: TrainAdvantage = field(default_factory=TrainAdvantage)
    output: TrainOutput = field(default_factory=TrainOutput)

    @classmethod
    def from_flat(cls, **options) -> TrainConfig:
        """A config from flat options, as flags and config files name them: ``TrainConfig.from_flat(lr=1e-4)``."""
        return compose(cls, options)

    def replace(self, **options) -> TrainConfig:
        """A copy with ``options`` (flat names) changed."""
        return compose(type(self), {**flatten(self), **options})

    @property
    def episodes_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.run.group_size

    @property
    def episodes_per_adam_step(self) -> float:
        return self.episodes_per_step / self.update.mini_batches

    @property
    def learning_rate(self) -> float:
        """``update.lr``, or when unset ``BASE_LR`` scaled to the batch (BENCHMARKS.md, issue 17)."""
        if self.update.lr is not None:
            return self.update.lr
        return BASE_LR * min(1.0, self.episodes_per_adam_step / BASE_EPISODES_PER_ADAM_STEP)

    def unstable_learning_rate(self) -> str | None:
        """A warning when the learning rate is known to wreck the policy at this batch size, else None.

        The bound keeps lr x 32 / (episodes per AdamW step) at or under twice the default's (the runs that
        set it: BENCHMARKS.md, issue 17)."""
        per_adam_step = self.episodes_per_adam_step
        if self.learning_rate * BASE_EPISODES_PER_ADAM_STEP / per_adam_step <= 2 * BASE_LR:
            return None
        return (f"lr {self.learning_rate:g} with {per_adam_step:g} episodes per AdamW step is known to be unstable "
                f"(noisy sign-like steps wreck the policy); use lr <= "
                f"{2 * BASE_LR * per_adam_step / BASE_EPISODES_PER_ADAM_STEP:.2g} (unset --lr scales it to the batch), "
                "or more episodes per step, or fewer mini-batches")

    def resolved(self) -> dict:
        """Every option, flat, with the values the run uses (the learning rate chosen): the saved config."""
        return {**flatten(self), "lr": self.learning_rate}

    @classmethod
    def resolve_saved(cls, saved: dict) -> dict:
        """A checkpoint's saved settings as :meth:`resolved` writes them: an unset ``lr`` (checkpoints from before
        the rate was saved resolved) becomes the rate those settings scale to."""
        if saved.get("lr", 0) is not None:
            return saved
        known = set(flatten(cls()))
        return {**saved, "lr": cls.from_flat(**{k: v for k, v in saved.items() if k in known}).learning_rate}

    def check(self) -> None:
        """The rules that tie training settings together (OptionError); then what follows from them: the resume
        folder, the default ``output_dir``, the rollout correction of a sampler in another precision, the learning
        rate of an unset ``lr``."""
        run, rollout, sampler, update, output = self.run, self.rollout, self.sampler, self.update, self.output
        rollout.check()
        if rollout.agent and rollout.max_staleness:
            raise OptionError("agent", "plays synchronous steps only: use it with {max_staleness} 0", rollout.agent)
        if run.steps is None:
            raise OptionError("steps", "must be set in train: an integer >= 1")
        if sampler.backend == "http" and not sampler.server:  # with --server the episodes are played there
            raise OptionError("backend", "needs at least one {server} URL (e.g. {server} http://127.0.0.1:8000)", "http")
        if output.resume is not None and output.overwrite:
            raise OptionError(None, "{resume} and {overwrite} exclude each other: {resume} continues the run")
        if output.resume is True:  # --resume alone: the run in --output-dir (unset: the default run folder)
            output.resume = output.output_dir or output.DEFAULT_OUTPUT_DIR
        self.correct_other_precision()
        update.check()
        try:
            sampler.server = [server_url(url) for url in sampler.server]
        except ValueError as error:
            raise OptionError("server", str(error), ",".join(sampler.server)) from None
        if output.output_dir is None:
            output.output_dir = output.default_output_dir()
        if self.episodes_per_step % update.mini_batches:
            raise OptionError("mini_batches", "must divide the episodes per step, {prompts_per_step} x {group_size} "
                              f"= {rollout.prompts_per_step} x {run.group_size} = {self.episodes_per_step}",
                              update.mini_batches)
        check_group_estimator(self.advantage.estimator, run.group_size)
        if rollout.filter_groups and run.group_size < 2:
            raise OptionError("filter_groups", "compares the outcomes of a question's samples; needs {group_size} 2 "
                              f"or more (got {run.group_size}: every group would be dropped)")
        update.lr = self.learning_rate  # unset: scaled to the batch, as the run uses it

    def correct_other_precision(self) -> None:
        """A sampler in another precision than the trainer's (``--rollout-dtype``) gets the field's correction,
        token-level truncated importance sampling at threshold 2 (verl's ``rollout_corr`` default; TRL, slime,
        prime-rl), unless ``--rollout-is``/``--rollout-rs`` already choose one; one line says so."""
        if self.sampler.rollout_dtype in (AUTO, self.run.dtype) or self.update.corrects_rollouts:
            return
        self.update.rollout_is = "token"
        risk = (". Not the default: bf16 sampling collapsed SmolLM2 runs that fp32's did not "
                "(docs/results/bf16_smollm2.md)" if self.sampler.rollout_dtype == "bf16" else "")
        print(f"note: rollouts sampled in {self.sampler.rollout_dtype}, trained in {self.run.dtype}: their mismatch "
              f"is corrected with --rollout-is token (threshold {self.update.rollout_is_threshold:g}); metrics "
              f"mismatch/*{risk}", file=sys.stderr)
