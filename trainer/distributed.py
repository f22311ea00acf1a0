"""Data-parallel training over ``torch.distributed``: one process per device, gloo on CPU, NCCL on CUDA.

Launch with ``torchrun --nproc-per-node N -m trainer ...`` or ``agent-loop train --nproc N`` (which
relaunches itself under torchrun). With one process every function here is the identity, and the
trainer does exactly what it did before.

How a step is split (``Trainer`` calls these at the marked places):

- **rollouts**: rank ``r`` plays the step's episodes ``r, r + N, r + 2N, ...`` on its own rollout
  backend; the trajectories are gathered (``all_gather_object``) so that every rank holds the whole
  step's batch, in episode order. Each episode's sampling seed depends only on its index, so the
  episodes are those a single process would play (up to the float rounding of a different decode
  batch).
- **scoring**: the batch is cut into the micro-batches one process would run
  (``trainer.policy.micro_batches``) and rank ``r`` runs micro-batches ``r, r + N, ...``, so every
  micro-batch computes exactly the numbers it computes in one process; an ``all_reduce(SUM)`` of the
  zero-filled ``(b, t)`` logprobs (and values) gives every rank the whole tensor, bit-identical to one
  process's.
- **advantages**: computed on the *whole* gathered batch by every rank, identically. So the group
  estimators (GRPO, RLOO, REINFORCE++-baseline) always see every sample of a prompt's group, and
  batch whitening uses the moments of the whole batch, whatever the sharding. (The alternative,
  all-reduced moments and groups kept on one rank, needs estimator-specific code; the batch tensors are
  small next to the model, so gathering them costs little.)
- **update**: the shuffled mini-batches and their micro-batches are those of one process; rank ``r``
  runs micro-batches ``r, r + N, ...`` of each mini-batch, weighting each by its ASSISTANT tokens over
  the *whole* mini-batch's tokens, and the gradients are summed (``all_reduce(SUM)``): the
  single-process gradient, up to the order of the float additions. Clipping and AdamW then run on
  identical gradients on every rank, so the replicas stay equal; ``check_replicas_equal`` verifies it
  at every checkpoint.

Why gradient all-reduce and not the ``DistributedDataParallel`` or FSDP2 wrappers: the trainer's
forward (``trainer.policy.response_forward``) calls the decoder and the output head separately (the
shared-prompt KV cache), which bypasses a wrapper's ``forward``; DDP's reducer needs its own forward
to arm the backward hooks, and ``fully_shard`` on the root module would not gather the output head's
parameters. The reduction is DDP's (a summed, bucketed all-reduce once per optimizer step, under
``no_sync`` semantics for the micro-batches); the model is replicated on every rank, so a checkpoint
is the plain model and loads into any number of ranks. Rank 0 writes metrics and checkpoints and
pushes weights to shared rollout servers.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``; other names as given
    (plain ``"cuda"`` under torchrun means ``cuda:LOCAL_RANK``). Raises ValueError for CUDA without one."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
        if device == "cuda":
            device = f"cuda:{local_rank}"
    return torch.device(device)


@dataclass
class DataParallel:
    """This process's place in the data-parallel group (``world_size`` 1: no group, every method a no-op)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, items):
        """This rank's share of ``items`` (a range, list or 1-D tensor): every ``world_size``-th item from ``rank``."""
        return items[self.rank :: self.world_size]

    @property
    def shard_of(self) -> tuple[int, int]:
        """``(rank, world_size)``, the ``shard`` argument of ``trainer.policy.micro_batches``."""
        return self.rank, self.world_size

    def gather_trajectories(self, trajectories: list) -> list:
        """Every rank's trajectories, on every rank, sorted by ``info["index"]`` (the episode order)."""
        if not self.enabled:
            return trajectories
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, trajectories)
        gathered = [t for part in parts for t in part]
        return sorted(gathered, key=lambda t: t.info["index"])

    def sum_rows_(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """In place: the sum over ranks of ``tensor`` (each rank filled its rows, zeros elsewhere)."""
        if self.enabled and tensor is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """Per-name sums of every rank's ``stats`` (a rank without a micro-batch contributes nothing)."""
        if not self.enabled:
            return dict(stats)
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, dict(stats))
        total: dict[str, float] = {}
        for part in parts:
            for name, value in part.items():
                total[name] = total.get(name, 0.0) + value
        return total

    def sum_gradients_(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's ``.grad`` over the ranks in one flat all-reduce (DDP's reduction).

        A parameter without a gradient on every rank keeps ``grad = None`` (as in one process); one with a
        gradient on some ranks gets the sum (zeros stand in for the others)."""
        if not self.enabled:
            return
        parameters = list(parameters)
        device = parameters[0].device
        has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.float32, device=device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.SUM)
        present = [p for p, flag in zip(parameters, has_grad.tolist()) if flag > 0]
        if not present:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in present])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in present:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def check_replicas_equal(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Raise RuntimeError if the ranks' parameters differ (compares float64 checksums; host sync)."""
        if not self.enabled:
            return
        with torch.no_grad():
            local = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in parameters])
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        for rank, part in enumerate(parts[1:], start=1):
            if not torch.equal(part, parts[0]):
                raise RuntimeError(f"data-parallel replicas diverged: rank {rank}'s parameters differ from rank 0's")


def init_data_parallel(device: str = "auto") -> DataParallel:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``),
    NCCL for CUDA and gloo for CPU; a single process (no ``WORLD_SIZE`` or 1) joins nothing."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DataParallel()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        cuda = resolve_device(device, local_rank).type == "cuda"
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    return DataParallel(rank=rank, world_size=world_size, local_rank=local_rank)


def close_data_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``python -m trainer ARGV`` in ``nproc`` processes on this machine (torchrun's standalone rendezvous);
    returns 0, or raises torchrun's ChildFailedError naming the failed rank."""
    from torch.distributed.run import main as torchrun

    # the workers need no --nproc (WORLD_SIZE tells them), and torchrun's own parser would take it for an
    # abbreviation of its --nproc-per-node
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "trainer", *rest])
    return 0


class NullLogger:
    """The metrics logger of ranks other than 0: writes nothing."""

    def __init__(self, path):
        self.path = path

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass
