"""Training settings: one dataclass, whose defaults train the built-in tiny agent on the arithmetic task on 2 CPU cores.

``TrainConfig`` takes the options every command that plays episodes shares (the run's, the task's, the
loop's, the servers' and the threads', each declared once: ``agent_loop.config``) and those it shares with
the warm start (:class:`OptimizerOptions`, :class:`OutputOptions`, :class:`DeviceOptions`, declared here),
and adds training's own; where training needs other defaults for them,
:func:`~agent_loop.config.override_defaults` says so (and ``--help`` says why). Every field is a flag
and a config-file key of ``agent-loop train``. Building a ``TrainConfig`` in code does not check it;
``agent_loop.config.checked`` does (the declarations, then :meth:`TrainConfig.check`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field

from agent_loop.backends.server_options import ServerOptions, server_url
from agent_loop.config import OptionError, ProgressOptions, closest, integer, number, one_of, override_defaults
from agent_loop.episode.config import LoopConfig
from agent_loop.proxy import AgentOptions
from agent_loop.runners.backend_choice import AUTO, BackendOptions
from agent_loop.runners.outputs import fresh_path
from agent_loop.runners.spec import EstimatorOptions, ResumeOptions, RunOptions, check_group_estimator
from agent_loop.tasks.registry import TaskOptions
from agent_loop.threads import ThreadOptions

# The learning rate measured stable on the tiny agent at 32 episodes per AdamW step; smaller batches scale it
# down in proportion (their gradients are noisier, and Adam's steps do not shrink with the signal).
BASE_LR = 2e-4
BASE_EPISODES_PER_ADAM_STEP = 32
# The warm start's: the tiny agent (1.1M parameters, trained from scratch at 3e-3) learns a new task's format and
# copies at its own training rate (BENCHMARKS.md, issue 29). A pretrained model: 1e-4, measured on SmolLM2-135M
# (benchmarks/warmstart_lr.py, BENCHMARKS.md issue 49: held-out sampled success 1.00 on arithmetic and lookup at
# 1e-4, 0.50 on arithmetic at 1e-5).
TINY_LR, MODEL_LR, MIN_LR_FRACTION = 3e-3, 1e-4, 0.1
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name
DEFAULT_OUTPUT_DIR = "runs/train"  # unset --output-dir: this, or the first free runs/train-N


def kl_kinds() -> tuple[str, ...]:
    """The sampled-token modes of ``advantages.kl_penalty`` ("full" needs whole-vocabulary log-probs)."""
    from advantages import KL_PENALTY_MODES

    return tuple(m for m in KL_PENALTY_MODES if m != "full")


def kl_kind_names() -> str:
    return one_of(kl_kinds())


def check_kl_kind(name: str) -> str:
    if name not in kl_kinds():
        raise ValueError(f"unknown KL estimator{closest(name, kl_kinds())} (choose {one_of(kl_kinds())})")
    return name


def check_device(name: str) -> str:
    if not (name in ("auto", "cpu") or name.split(":")[0] == "cuda"):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return name


def _int(low: int, text: str):
    return integer(text, low)


@dataclass
class OptimizerOptions:
    """AdamW and its schedule, for every command that trains (train, warmstart). ``learning_rate``: ``lr``, or
    the command's :meth:`default_lr` when unset; ``resolved()``: the settings as the run uses them."""

    lr: Annotated[float | None, Field(gt=0, description=(
        "AdamW learning rate (the peak, after --warmup-steps); unset: train scales "
        f"{BASE_LR:g} to the batch ({BASE_LR:g} x episodes per AdamW step / {BASE_EPISODES_PER_ADAM_STEP}, at most "
        f"{BASE_LR:g}); warmstart takes {TINY_LR:g} for the built-in tiny agent (unset --model), {MODEL_LR:g} for a "
        f"--model, and decays it on a cosine to {MIN_LR_FRACTION:g} of the peak"))] = None
    warmup_steps: _int(0, "steps over which the learning rate rises linearly to --lr; Adam's first, "
                          "bias-corrected steps are full-size sign steps, which noisy small batches turn into "
                          "random moves of every weight (0 = off)") = 10
    weight_decay: number("AdamW weight decay", ge=0) = 0.0
    max_grad_norm: number("gradient clipping norm", gt=0) = 1.0
    micro_batch_size: _int(1, "rows per forward/backward (gradient accumulation within an optimizer step)") = 16

    def default_lr(self) -> float:
        raise NotImplementedError(f"{type(self).__name__} names no default learning rate")

    @property
    def learning_rate(self) -> float:
        """``lr`` when set, else the command's :meth:`default_lr`."""
        return self.lr if self.lr is not None else self.default_lr()

    def resolved(self) -> dict:
        """Every setting with the values the run uses (the learning rate chosen): the saved config."""
        return {**dataclasses.asdict(self), "lr": self.learning_rate}


@dataclass
class OutputOptions(ProgressOptions):
    """The run's folder and how the run reports, for every command that writes one (train, warmstart); the
    progress bar's option is every command's (:class:`~agent_loop.config.ProgressOptions`)."""

    DEFAULT_OUTPUT_DIR: ClassVar[str] = "runs/run"  # each command's own: runs/train, runs/warmstart

    output_dir: Annotated[str | None, Field(description=(
        "the run's folder: metrics.jsonl, config.yaml and what the command makes (train: checkpoints/; warmstart: "
        "model/, demonstrations.jsonl); unset: runs/COMMAND (runs/train, runs/warmstart) or the first free "
        "runs/COMMAND-N (train --resume: the resumed run's folder); a folder holding an earlier run is refused "
        "without --overwrite (train: or --resume)"), json_schema_extra={"allowed": "a folder path"})] = None
    overwrite: Annotated[bool, Field(description="replace the earlier run in --output-dir (its files are deleted "
                                     "first)")] = False
    save_every: _int(1, "steps between checkpoints (OUTPUT_DIR/checkpoints; and one at the end): a stopped run goes "
                        "on from the latest complete one with --resume") = 20

    def default_output_dir(self) -> str:
        """Never an earlier run's folder: DEFAULT_OUTPUT_DIR, or the first free DEFAULT_OUTPUT_DIR-N."""
        return fresh_path(self.DEFAULT_OUTPUT_DIR)


@dataclass
class DeviceOptions:
    """Where the model trains (train, warmstart)."""

    device: Annotated[str, AfterValidator(check_device), Field(
        description="auto: CUDA when available (cuda:LOCAL_RANK under torchrun), else cpu",
        json_schema_extra={"allowed": "auto, cpu, cuda or cuda:N"})] = "auto"


@dataclass
class StepsOptions:
    """How long a run trains (train, warmstart; declared once)."""

    steps: Annotated[int | None, Field(ge=1, description=(
        "steps to train: train's RL steps (each plays a batch, then --ppo-epochs x --mini-batches AdamW steps); "
        "warmstart's AdamW steps (unset: --epochs passes over the demonstrations)"),
        json_schema_extra={"allowed": "an integer >= 1 (warmstart: or unset)"})] = None


def run_folder_of(resume: str) -> str:
    """The run folder a ``--resume`` folder names: OUTPUT_DIR, OUTPUT_DIR/checkpoints or
    OUTPUT_DIR/checkpoints/step_N."""
    path = Path(resume)
    if path.name == "checkpoints":
        return str(path.parent)
    return str(path.parent.parent if path.parent.name == "checkpoints" else path)


# agent-loop rollout's defaults differ; --help says why beside each
SHORTER_EPISODES = ("train's own, not rollout's (shorter episodes, more at once): the built-in tasks take 2 turns, "
                    "and the tiny agent's RL results (BENCHMARKS.md) were trained and are reproduced with these; "
                    "raise them for longer tasks")


@override_defaults({**dict.fromkeys(("concurrency", "max_turns", "max_tokens", "max_response_tokens"),
                                    SHORTER_EPISODES),
                    "steps": "train's own: a run of RL steps must be given a length (warmstart's follows its data)"},
                   concurrency=64, max_turns=3, max_tokens=48, max_response_tokens=256, steps=150)
class TrainConfig(AgentOptions, ThreadOptions, DeviceOptions, OutputOptions, OptimizerOptions, BackendOptions,
                  ServerOptions, LoopConfig, TaskOptions, ResumeOptions, EstimatorOptions, StepsOptions, RunOptions):
    """Everything one training run needs. The CLI exposes every field as ``--field-name``."""

    DEFAULT_OUTPUT_DIR: ClassVar[str] = DEFAULT_OUTPUT_DIR

    tiny_stage: Annotated[Literal["mid", "final"], Field(
        description="the built-in tiny agent (when --model is unset): mid = a middling warm start for RL, "
                    "final = fully trained")] = "mid"

    # rollouts: each step plays prompts_per_step * group_size episodes with the current policy
    prompts_per_step: _int(1, "questions per step") = 64

    # rewards and advantages
    lam: number("GAE lambda (estimators gae and turn_gae only)", ge=0, le=1) = 0.95
    step_advantage_w: number("weight omega of gigpo's step-level (anchor-state group) advantage beside its "
                             "episode-level one (estimator gigpo only)", ge=0) = 1.0
    gigpo_mode: Annotated[Literal["mean_norm", "mean_std_norm"], Field(
        description="gigpo's group normalisation: mean_norm subtracts the group mean (GiGPO's default), "
                    "mean_std_norm also divides by the group std (estimator gigpo only)")] = "mean_norm"
    kl_coef: number("KL penalty to the frozen initial policy, subtracted from ASSISTANT token rewards; 0 = off",
                     ge=0) = 0.0
    kl_kind: Annotated[str, AfterValidator(check_kl_kind), Field(
        description="KL estimator (a sampled-token mode of advantages.kl_penalty)",
        json_schema_extra={"allowed": kl_kind_names})] = "k1"

    # PPO update
    ppo_epochs: _int(1, "passes over each step's episodes") = 1
    mini_batches: _int(1, "optimizer steps per epoch; must divide prompts_per_step * group_size") = 2
    clip_ratio: number("PPO clip range epsilon", gt=0) = 0.2
    entropy_coef: number("entropy bonus weight", ge=0) = 0.0
    value_coef: number("weight of the value head's loss (gae only)", ge=0) = 0.5
    recompute_old_logprobs: Annotated[bool, Field(
        description="recompute the PPO reference logprobs with the policy (off: use the sampler's)")] = True
    max_staleness: _int(0, "asynchronous training: 0 = synchronous steps (play, then train); K >= 1 = a rollout "
                           "producer keeps playing (on the --server(s) or the in-process backend) while the "
                           "trainer trains, episodes in flight take new weights between turns, and a step trains "
                           "only on episodes whose oldest token was sampled at most K steps ago (older ones are "
                           "dropped: episodes/dropped_stale; docs/design.md 8a)") = 0
    off_policy: Annotated[bool, Field(
        description="deprecated: the same as --max-staleness 1")] = False

    # dynamic sampling (DAPO's filter_groups; agent_loop/runners/group_filter.py)
    filter_groups: Annotated[bool, Field(
        description="dynamic sampling (DAPO's filter_groups): drop the groups whose sessions' raw outcomes (the "
                    "task's success, not the shaped reward) are all equal, and play fresh questions until the step "
                    "holds --prompts-per-step groups, or --filter-groups-max-rounds extra rounds were played "
                    "(metrics filter_groups/*; needs --group-size 2 or more)")] = False
    filter_groups_max_rounds: _int(0, "--filter-groups: the extra rounds (each --prompts-per-step groups) a step may "
                                      "play beyond its first before it trains on the groups it kept "
                                      "(filter_groups/bound_hit 1); 9: verl's max_num_gen_batches 10 in all") = 9

    # sampler/trainer mismatch correction (advantages/rollout_correction.py; verl's algorithm.rollout_correction,
    # docs/verl.md): the ratio rho = exp(old_logprob - rollout_logprob) of the trainer's logprobs to the sampler's
    rollout_is: Annotated[Literal["off", "token", "sequence"], Field(
        description="truncated importance sampling (verl's rollout_is): each ASSISTANT token's PPO loss times "
                    "min(rho, --rollout-is-threshold), per token or one weight per episode (the product of its "
                    "tokens' ratios); off: metrics (mismatch/*) only")] = "off"
    rollout_is_threshold: number("the cap C of the importance weights (verl's rollout_is_threshold)", gt=0) = 2.0
    rollout_rs: Annotated[Literal["off", "token", "sequence"], Field(
        description="masked importance sampling / rejection (verl's rollout_rs token_k1, seq_sum_k1): drop from the "
                    "loss the ASSISTANT tokens whose ratio, or the episodes whose product ratio, lies outside "
                    "[--rollout-rs-lower, --rollout-rs-upper]")] = "off"
    rollout_rs_lower: number("lower bound of the kept ratios (--rollout-rs)", gt=0) = 0.5
    rollout_rs_upper: number("upper bound of the kept ratios (--rollout-rs)", gt=0) = 2.0

    # LoRA (agent_loop/training/lora.py, the ``lora`` extra)
    lora_rank: _int(0, "LoRA rank; 0 = train every weight") = 0
    lora_alpha: number("LoRA alpha", gt=0) = 16.0
    lora_target_modules: Annotated[str, Field(
        description='"all-linear" or comma-separated module names, e.g. "q_proj,v_proj"')] = "all-linear"

    # output (beside OutputOptions')
    tensorboard: Annotated[bool, Field(description="write TensorBoard event files to OUTPUT_DIR/tensorboard")] = True
    wandb_project: Annotated[str | None, Field(description="also log each step to this Weights & Biases project "
                                               "(needs `pip install wandb`; WANDB_MODE=offline works without "
                                               "an account)")] = None
    save_rollouts_every: _int(0, "steps between saved training rollouts (OUTPUT_DIR/rollouts/step_NNNNNN.jsonl, "
                                 "with the returns and advantages each step used); 0 = none") = 1
    eval_every: _int(0, "steps between greedy evaluations on held-out questions; 0 = never") = 0
    eval_episodes: _int(1, "held-out questions per evaluation") = 100

    # hardware and processes (agent_loop/training/distributed.py; --device: DeviceOptions)
    dtype: Annotated[Literal[tuple(DTYPES)], Field(
        description="bf16: forward passes under bf16 autocast, fp32 master weights and AdamW state")] = "fp32"
    nproc: _int(1, "data-parallel processes; > 1 relaunches under torchrun (gloo on CPU, NCCL on CUDA)") = 1
    parallel: Annotated[Literal["auto", "ddp", "fsdp"], Field(
        description="data-parallel wrapper with several processes: ddp (DistributedDataParallel, replicas), "
                    "fsdp (FSDP2 fully_shard, sharded; not with LoRA); auto: fsdp on CUDA, ddp on CPU or with LoRA")] = \
        "auto"
    rollout_servers: InitVar[Annotated[str | None, Field(
        description="the old name of --server: comma-separated server URLs")]] = None

    def __post_init__(self, rollout_servers: str | None = None):
        super().__post_init__()
        if rollout_servers:  # configs saved before --server: one comma-separated string
            self.server = [*self.server, *(url for url in rollout_servers.split(",") if url.strip())]

    @property
    def episodes_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def episodes_per_adam_step(self) -> float:
        return self.episodes_per_step / self.mini_batches

    def default_lr(self) -> float:
        """BASE_LR scaled to the batch (BENCHMARKS.md, issue 17)."""
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

    def check(self) -> None:
        """The rules that tie training settings together (OptionError); then the default ``output_dir``."""
        TaskOptions.check(self)
        if self.off_policy:  # the deprecated alias of --max-staleness 1
            import warnings

            warnings.warn("off_policy is deprecated: use max_staleness 1 (--max-staleness 1)", FutureWarning,
                          stacklevel=2)
            self.max_staleness = max(self.max_staleness, 1)
        if self.agent and self.max_staleness:
            raise OptionError("agent", "plays synchronous steps only: use it with {max_staleness} 0", self.agent)
        if self.steps is None:
            raise OptionError("steps", "must be set in train: an integer >= 1")
        if self.backend == "http" and not self.server:  # with --server the episodes are played there, as rollout's
            raise OptionError("backend", "needs at least one {server} URL (e.g. {server} http://127.0.0.1:8000)", "http")
        if self.resume is not None and self.overwrite:
            raise OptionError(None, "{resume} and {overwrite} exclude each other: {resume} continues the run")
        if self.resume is True:  # --resume alone: the run in --output-dir (unset: the default run folder)
            self.resume = self.output_dir or self.DEFAULT_OUTPUT_DIR
        self.correct_other_precision()
        self.check_rollout_correction()
        try:  # --rollout-servers (the old name) gives URLs unchecked
            self.server = [server_url(url) for url in self.server]
        except ValueError as error:
            raise OptionError("server", str(error), ",".join(self.server)) from None
        if self.output_dir is None:
            self.output_dir = self.default_output_dir()
        if self.episodes_per_step % self.mini_batches:
            raise OptionError("mini_batches", "must divide the episodes per step, {prompts_per_step} x {group_size} "
                              f"= {self.prompts_per_step} x {self.group_size} = {self.episodes_per_step}",
                              self.mini_batches)
        check_group_estimator(self.estimator, self.group_size)
        if self.filter_groups and self.group_size < 2:
            raise OptionError("filter_groups", "compares the outcomes of a question's samples; needs {group_size} 2 "
                              f"or more (got {self.group_size}: every group would be dropped)")

    @property
    def corrects_rollouts(self) -> bool:
        """Whether the sampler/trainer mismatch is corrected (``rollout_is`` or ``rollout_rs`` on)."""
        return self.rollout_is != "off" or self.rollout_rs != "off"

    def rollout_correction_options(self) -> dict:
        """The keywords of ``advantages.correct_rollouts`` these settings give."""
        names = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_lower", "rollout_rs_upper")
        return {name: getattr(self, name) for name in names}

    def correct_other_precision(self) -> None:
        """A sampler in another precision than the trainer's (``--rollout-dtype``) gets the field's correction,
        token-level truncated importance sampling at threshold 2 (verl's ``rollout_corr`` default; TRL, slime,
        prime-rl), unless ``--rollout-is``/``--rollout-rs`` already choose one; one line says so."""
        if self.rollout_dtype in (AUTO, self.dtype) or self.corrects_rollouts:
            return
        self.rollout_is = "token"
        print(f"note: rollouts sampled in {self.rollout_dtype}, trained in {self.dtype}: their mismatch is corrected "
              f"with --rollout-is token (threshold {self.rollout_is_threshold:g}); metrics mismatch/*", file=sys.stderr)

    def check_rollout_correction(self) -> None:
        if self.rollout_rs_lower > self.rollout_rs_upper:
            raise OptionError("rollout_rs_lower", "must not exceed {rollout_rs_upper} "
                              f"({self.rollout_rs_upper})", self.rollout_rs_lower)
        if self.corrects_rollouts and not self.recompute_old_logprobs:
            raise OptionError(None, "{rollout_is} / {rollout_rs} weigh the trainer's recomputed logprobs against the "
                              "sampler's: they need {recompute_old_logprobs} (without it the ratio is 1)")

    def default_output_dir(self) -> str:
        """The run folder of ``resume`` (a run folder, or the one a checkpoint folder is in), else a fresh one.

        Under torchrun every process must name the same folder, so there it must be given."""
        if self.resume is not None:
            return run_folder_of(self.resume)
        if "WORLD_SIZE" in os.environ:
            raise OptionError("output_dir", "must be given under torchrun (every process writes to one folder)")
        return super().default_output_dir()
