"""Training settings: one dataclass, whose defaults train the built-in tiny agent on the arithmetic task on 2 CPU cores."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # advantages relative to a prompt's group


@dataclass
class TrainConfig:
    """Everything one training run needs. The CLI exposes every field as ``--field-name``."""

    # what to train
    model: str | None = None  # model dir; None = the built-in tiny agent at ``tiny_stage``
    tiny_stage: str = "mid"  # "mid": a middling warm start for RL; "final": the fully trained tiny agent
    task: str = "arithmetic"
    seed: int = 0

    # rollouts: each step plays prompts_per_step * group_size episodes with the current policy
    steps: int = 150
    prompts_per_step: int = 64
    group_size: int = 1  # samples per prompt; GRPO, RLOO and REINFORCE++-baseline need 2 or more (e.g. 16 x 4)
    concurrency: int = 64  # episodes in flight (the transformers backend batches them)
    max_turns: int = 3
    max_tokens: int = 48  # per assistant turn
    max_response_tokens: int = 256
    temperature: float = 1.0

    # rewards and advantages
    estimator: str = "reinforce_plus_plus"  # any name in advantages' registry
    returns_variant: str = "carry_through"  # ablation only: "reset_at_observation" or "ignore_mask" (pre-fix bugs)
    gamma: float = 1.0
    lam: float = 0.95  # GAE only
    kl_coef: float = 0.0  # KL penalty to the frozen initial policy, subtracted from ASSISTANT token rewards
    kl_kind: str = "k1"  # k1, k2 or k3

    # PPO update
    lr: float = 2e-4
    weight_decay: float = 0.0
    ppo_epochs: int = 1
    mini_batches: int = 2  # optimizer steps per epoch
    micro_batch_size: int = 16  # rows per forward/backward (gradient accumulation within a mini-batch)
    clip_ratio: float = 0.2
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0
    value_coef: float = 0.5  # GAE only: weight of the value head's loss
    recompute_old_logprobs: bool = True  # False: use the sampler's logprobs as the PPO reference
    # one-step off-policy: step k+1's rollouts play while step k trains; the sampler's logprobs are the
    # behaviour policy in the ratio of those steps; metric ``policy_lag``. One process, in-process backend only
    off_policy: bool = False

    # LoRA (trainer/lora.py, the ``lora`` extra): rank 0 = train every weight
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: str = "all-linear"  # or comma-separated module names: "q_proj,v_proj"

    # output
    output_dir: str = "runs/train"
    save_every: int = 20  # steps between checkpoints (and one at the end)
    eval_every: int = 0  # steps between greedy evaluations on held-out questions; 0 = never
    eval_episodes: int = 100
    resume: str | None = None  # a checkpoint dir to continue from
    threads: int = 2  # torch intra-op threads (per process)
    progress: bool = True

    # hardware and processes (trainer/distributed.py)
    device: str = "auto"  # "auto": CUDA when available (cuda:LOCAL_RANK under torchrun), else "cpu"; or "cpu", "cuda", "cuda:1"
    dtype: str = "fp32"  # "fp32", or "bf16": forward passes under bf16 autocast, fp32 master weights and AdamW state
    # rollouts on running vLLM servers (started with VLLM_SERVER_DEV_MODE=1, same machine or a shared
    # filesystem): comma-separated URLs; rank 0 pushes the new weights to every one after each step
    rollout_servers: str | None = None
    served_model_name: str = "policy"
    nproc: int = 1  # data-parallel processes; > 1 relaunches ``agent-loop train`` under torchrun (gloo on CPU, NCCL on CUDA)

    @property
    def episodes_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def validate(self) -> None:
        """Raise ValueError for settings that cannot work together."""
        if self.episodes_per_step % self.mini_batches:
            raise ValueError(f"episodes per step ({self.episodes_per_step}) must divide into {self.mini_batches} mini-batches")
        if self.estimator in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(f"estimator {self.estimator!r} compares samples of the same prompt: set group_size >= 2")
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_kind must be k1, k2 or k3, got {self.kl_kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "auto" or self.device == "cpu" or self.device.split(":")[0] == "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be 0 (no LoRA) or positive, got {self.lora_rank}")
        for name in ("nproc", "steps", "prompts_per_step", "group_size", "ppo_epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
