"""Training settings: one dataclass, whose defaults train the built-in tiny agent on the arithmetic task on 2 CPU cores.

Each field is declared with its allowed values and help (``Annotated[type, Field(...)]``), the one
place ``agent-loop train`` (and a config file) reads options, help text and checks from
(``agent_loop.options``). Building a ``TrainConfig`` in code does not check; ``validate_values`` and
``TrainConfig.validate`` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from agent_loop import options

from advantages import KL_PENALTY_MODES, get_estimator

# The learning rate measured stable on the tiny agent at 32 episodes per AdamW step; smaller batches scale it
# down in proportion (their gradients are noisier, and Adam's steps do not shrink with the signal).
BASE_LR = 2e-4
BASE_EPISODES_PER_ADAM_STEP = 32
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name
# sampled-token modes of advantages.kl_penalty ("full" needs whole-vocabulary log-probs)
KL_KINDS = tuple(m for m in KL_PENALTY_MODES if m != "full")


def kl_kind_names() -> str:
    return options.one_of(KL_KINDS)


def check_kl_kind(name: str) -> str:
    if name not in KL_KINDS:
        raise ValueError(f"unknown KL estimator{options.closest(name, KL_KINDS)} (choose {options.one_of(KL_KINDS)})")
    return name


def check_device(name: str) -> str:
    if not (name in ("auto", "cpu") or name.split(":")[0] == "cuda"):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return name


def _int(low: int, text: str):
    return Annotated[int, Field(ge=low, description=text)]


@dataclass
class TrainConfig:
    """Everything one training run needs. The CLI exposes every field as ``--field-name``."""

    __pydantic_config__ = options.STRICT_NUMBERS

    # what to train
    model: Annotated[str | None, Field(description="model folder to start from; unset: the built-in tiny agent "
                                       "at --tiny-stage", json_schema_extra={"allowed": "a folder"})] = None
    tiny_stage: Annotated[Literal["mid", "final"], Field(
        description="built-in tiny agent: mid = a middling warm start for RL, final = fully trained")] = "mid"
    task: Annotated[str, AfterValidator(options.check_task),
                    Field(description="task to train on", json_schema_extra={"allowed": options.task_names})] = "arithmetic"
    seed: _int(0, "seed of the questions and of sampling") = 0

    # rollouts: each step plays prompts_per_step * group_size episodes with the current policy
    steps: _int(1, "training steps") = 150
    prompts_per_step: _int(1, "questions per step") = 64
    group_size: _int(1, "samples per question; grpo, rloo and reinforce_plus_plus_baseline need 2 or more") = 1
    concurrency: _int(1, "episodes in flight (the transformers backend batches them)") = 64
    max_turns: _int(1, "assistant turns per episode") = 3
    max_tokens: _int(1, "tokens per assistant turn") = 48
    max_response_tokens: _int(1, "assistant + observation tokens per episode") = 256
    temperature: Annotated[float, Field(gt=0, description="sampling temperature of the rollouts")] = 1.0

    # rewards and advantages
    estimator: Annotated[str, AfterValidator(options.check_estimator),
                         Field(description="advantage estimator (the two reinforce_plus_plus_* variants reproduce "
                                           "pre-PR #7300 return bugs: ablation only)",
                               json_schema_extra={"allowed": options.estimator_names})] = "reinforce_plus_plus"
    gamma: Annotated[float, Field(ge=0, le=1, description="discount")] = 1.0
    lam: Annotated[float, Field(ge=0, le=1, description="GAE lambda (estimator gae only)")] = 0.95
    kl_coef: Annotated[float, Field(ge=0, description="KL penalty to the frozen initial policy, subtracted from "
                                    "ASSISTANT token rewards; 0 = off")] = 0.0
    kl_kind: Annotated[str, AfterValidator(check_kl_kind), Field(
        description="KL estimator (a sampled-token mode of advantages.kl_penalty)",
        json_schema_extra={"allowed": kl_kind_names})] = "k1"

    # PPO update
    lr: Annotated[float | None, Field(gt=0, description=f"AdamW learning rate; unset: {BASE_LR:g} x (episodes per "
                                      f"AdamW step / {BASE_EPISODES_PER_ADAM_STEP}), at most {BASE_LR:g}")] = None
    warmup_steps: _int(0, "steps over which the learning rate rises linearly to --lr; Adam's first, "
                          "bias-corrected steps are full-size sign steps, which noisy small batches turn into "
                          "random moves of every weight (0 = off)") = 10
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    ppo_epochs: _int(1, "passes over each step's episodes") = 1
    mini_batches: _int(1, "optimizer steps per epoch; must divide prompts_per_step * group_size") = 2
    micro_batch_size: _int(1, "rows per forward/backward (gradient accumulation within a mini-batch)") = 16
    clip_ratio: Annotated[float, Field(gt=0, description="PPO clip range epsilon")] = 0.2
    max_grad_norm: Annotated[float, Field(gt=0, description="gradient clipping norm")] = 1.0
    entropy_coef: Annotated[float, Field(ge=0, description="entropy bonus weight")] = 0.0
    value_coef: Annotated[float, Field(ge=0, description="weight of the value head's loss (gae only)")] = 0.5
    recompute_old_logprobs: Annotated[bool, Field(
        description="recompute the PPO reference logprobs with the policy (off: use the sampler's)")] = True
    off_policy: Annotated[bool, Field(
        description="one-step off-policy: step k+1's rollouts play while step k trains, the sampler's logprobs "
                    "are the behaviour policy (metric policy_lag); one process, in-process backend only")] = False

    # LoRA (trainer/lora.py, the ``lora`` extra)
    lora_rank: _int(0, "LoRA rank; 0 = train every weight") = 0
    lora_alpha: Annotated[float, Field(gt=0, description="LoRA alpha")] = 16.0
    lora_target_modules: Annotated[str, Field(
        description='"all-linear" or comma-separated module names, e.g. "q_proj,v_proj"')] = "all-linear"

    # output
    output_dir: Annotated[str, Field(description="metrics.jsonl and checkpoints/ go here",
                                     json_schema_extra={"allowed": "a folder path"})] = "runs/train"
    tensorboard: Annotated[bool, Field(description="write TensorBoard event files to OUTPUT_DIR/tensorboard")] = True
    wandb_project: Annotated[str | None, Field(description="also log each step to this Weights & Biases project "
                                               "(needs `pip install wandb`; WANDB_MODE=offline works without "
                                               "an account)")] = None
    save_every: _int(1, "steps between checkpoints (and one at the end)") = 20
    eval_every: _int(0, "steps between greedy evaluations on held-out questions; 0 = never") = 0
    eval_episodes: _int(1, "held-out questions per evaluation") = 100
    resume: Annotated[str | None, Field(description="checkpoint folder (OUTPUT_DIR/checkpoints/step_NNNNNN), or a run "
                                        "folder (its latest complete checkpoint), to continue from",
                                        json_schema_extra={"allowed": "a checkpoint or run folder"})] = None
    allow_config_change: Annotated[bool, Field(
        description="resume even when settings differ from the checkpoint's (the differences are listed)")] = False
    threads: _int(1, "torch intra-op threads (per process)") = 2
    progress: Annotated[bool, Field(description="progress bar")] = True

    # hardware and processes (trainer/distributed.py)
    device: Annotated[str, AfterValidator(check_device), Field(
        description="auto: CUDA when available (cuda:LOCAL_RANK under torchrun), else cpu",
        json_schema_extra={"allowed": "auto, cpu, cuda or cuda:N"})] = "auto"
    dtype: Annotated[Literal["fp32", "bf16"], Field(
        description="bf16: forward passes under bf16 autocast, fp32 master weights and AdamW state")] = "fp32"
    rollout_servers: Annotated[str | None, Field(
        description="comma-separated URLs of vLLM servers (started with VLLM_SERVER_DEV_MODE=1) to roll out on; "
                    "rank 0 pushes the new weights to each after every step",
        json_schema_extra={"allowed": "comma-separated http(s) URLs"})] = None
    served_model_name: Annotated[str, Field(description="model name the rollout servers serve")] = "policy"
    nproc: _int(1, "data-parallel processes; > 1 relaunches under torchrun (gloo on CPU, NCCL on CUDA)") = 1
    parallel: Annotated[Literal["auto", "ddp", "fsdp"], Field(
        description="data-parallel wrapper with several processes: ddp (DistributedDataParallel, replicas), "
                    "fsdp (FSDP2 fully_shard, sharded; not with LoRA); auto: fsdp on CUDA, ddp on CPU or with LoRA")] = \
        "auto"

    @property
    def episodes_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def episodes_per_adam_step(self) -> float:
        return self.episodes_per_step / self.mini_batches

    @property
    def learning_rate(self) -> float:
        """``lr`` when set, else BASE_LR scaled to the batch (BENCHMARKS.md, issue 17)."""
        if self.lr is not None:
            return self.lr
        return BASE_LR * min(1.0, self.episodes_per_adam_step / BASE_EPISODES_PER_ADAM_STEP)

    def unstable_learning_rate(self) -> str | None:
        """A warning when the learning rate is known to wreck the policy at this batch size, else None.

        Measured on the tiny agent (BENCHMARKS.md, issue 17): 8 episodes per AdamW step at lr 2e-4 took
        held-out success from 0.45 to 0.05 in 4 steps; 32 per step at 2e-4, or 8 at 5e-5, held it. The
        bound keeps lr x 32 / (episodes per AdamW step) at or under 4e-4 (twice the default's)."""
        per_adam_step = self.episodes_per_adam_step
        if self.learning_rate * BASE_EPISODES_PER_ADAM_STEP / per_adam_step <= 2 * BASE_LR:
            return None
        return (f"lr {self.learning_rate:g} with {per_adam_step:g} episodes per AdamW step is known to be unstable "
                f"(noisy sign-like steps wreck the policy); use lr <= "
                f"{2 * BASE_LR * per_adam_step / BASE_EPISODES_PER_ADAM_STEP:.2g} (unset --lr scales it to the batch), "
                "or more episodes per step, or fewer mini-batches")

    def validate(self) -> None:
        """Raise ValueError for settings that cannot work together."""
        if self.episodes_per_step % self.mini_batches:
            raise ValueError(f"episodes per step ({self.episodes_per_step}) must divide into {self.mini_batches} mini-batches")
        if get_estimator(self.estimator).needs_index and self.group_size < 2:
            raise ValueError(f"estimator {self.estimator!r} compares samples of the same prompt: set group_size >= 2")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {list(KL_KINDS)}, got {self.kl_kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        for name in ("nproc", "steps", "prompts_per_step", "group_size", "ppo_epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def validate_values(values: dict, *, keys: bool = False) -> TrainConfig:
    """A checked TrainConfig from ``values`` (parsed flags, or a config file's keys with ``keys=True``):
    every field against its declaration, then the rules that tie fields together. UsageError (one line)."""
    config = options.validate(TrainConfig, values, keys=keys)
    name = (lambda n: n) if keys else options.flag
    if config.episodes_per_step % config.mini_batches:
        raise options.UsageError(
            f"{name('mini_batches')} {config.mini_batches}: must divide the episodes per step, {name('prompts_per_step')}"
            f" x {name('group_size')} = {config.prompts_per_step} x {config.group_size} = {config.episodes_per_step}")
    if get_estimator(config.estimator).needs_index and config.group_size < 2:
        raise options.UsageError(f"{name('estimator')} {config.estimator}: compares samples of the same question; "
                                 f"needs {name('group_size')} 2 or more (got {config.group_size})")
    try:
        config.validate()
    except ValueError as error:
        raise options.UsageError(str(error)) from None
    return config
