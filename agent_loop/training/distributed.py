"""Data-parallel training over ``torch.distributed``: one process per device, gloo on CPU, NCCL on CUDA.

Launch with ``torchrun --nproc-per-node N -m trainer ...`` or ``agent-loop train --nproc N`` (which
relaunches itself under torchrun). With one process every function here is the identity, and the
trainer does exactly what it did before.

The policy is wrapped by torch's own data-parallel wrappers (``--parallel``):

- ``ddp``: ``DistributedDataParallel``: a replica per rank, gradients all-reduced in buckets during
  the backward of each mini-batch's last micro-batch (``no_sync`` for the ones before it);
- ``fsdp``: FSDP2, ``fully_shard`` on every decoder layer and then on the root: parameters, gradients
  and AdamW state sharded across the ranks, each layer's parameters all-gathered for its forward and
  backward, gradients reduce-scattered (``set_requires_gradient_sync(False)`` before the last
  micro-batch). It runs on CUDA (NCCL) and, with torch 2.13, on CPU (gloo) too; not with LoRA (the
  adapters are small: ``ddp``). Every row runs its whole prompt (no shared-prompt KV cache: gradient
  through the cache reaches the layers' key/value projections after FSDP2 has resharded them);
- ``auto`` (default): ``fsdp`` on CUDA, ``ddp`` on CPU or with LoRA.

What is wrapped is ``agent_loop.training.policy.PolicyModel``: the whole forward (shared-prompt KV cache, decoder,
output head, value head; batch tensors in, per-token logprobs, entropy and values out) is one module
call, so DDP's reducer arms its hooks and ``fully_shard``'s root gathers the head. Both wrappers
*sum* the ranks' gradients (a DDP comm hook; FSDP's gradient divide factor 1): each micro-batch's
loss is already weighted by its share of the whole mini-batch's ASSISTANT tokens.

How a step is split (``Trainer`` calls these at the marked places):

- **rollouts**: rank ``r`` plays the step's episodes ``r, r + N, r + 2N, ...`` on its own rollout
  backend; the trajectories are gathered (``all_gather_object``) so that every rank holds the whole
  step's batch, in episode order. Each episode's sampling seed depends only on its index, so the
  episodes are those a single process would play (up to the float rounding of a different decode
  batch).
- **scoring**: the batch is cut into the micro-batches one process would run
  (``agent_loop.training.policy.micro_batches``) and rank ``r`` runs micro-batches ``r, r + N, ...``, so every
  micro-batch computes exactly the numbers it computes in one process; an ``all_reduce(SUM)`` of the
  zero-filled ``(b, t)`` logprobs (and values) gives every rank the whole tensor.
- **advantages**: computed on the *whole* gathered batch by every rank, identically. So the group
  estimators (GRPO, RLOO, REINFORCE++-baseline) always see every sample of a prompt's group, and
  batch whitening uses the moments of the whole batch, whatever the sharding. (The alternative,
  all-reduced moments and groups kept on one rank, needs estimator-specific code; the batch tensors are
  small next to the model, so gathering them costs little.)
- **update**: the shuffled mini-batches and their micro-batches are those of one process; rank ``r``
  runs micro-batches ``r, r + N, ...`` of each mini-batch, weighting each by its ASSISTANT tokens over
  the *whole* mini-batch's tokens; the wrapper sums the gradients: the single-process gradient, up to
  the order of the float additions. A rank with fewer micro-batches than another runs a stand-in at
  weight 0, so every rank runs as many forwards and backwards and the wrappers' collectives pair up.
  Clipping and AdamW then run on identical gradients (DDP: replicas stay equal,
  ``check_replicas_equal`` verifies it at every checkpoint) or on each rank's shard (FSDP).

Workers die with their launcher (:func:`die_with_launcher`): torchrun starts each in its own session,
so without it a SIGKILLed ``agent-loop train --nproc N`` would leave them training alone; and they check
their launcher before every write, so no step, checkpoint or rollout file is written after it died.

Rank 0 writes metrics and checkpoints and pushes weights to shared rollout servers. A checkpoint is the
plain transformers model and an unsharded optimizer state (FSDP: gathered from the shards, every rank
taking part), so it loads into any number of ranks and either wrapper.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.run import main as torchrun
from torch.distributed.tensor import DTensor, distribute_tensor

import agent_loop.files as files

PARALLEL_MODES = ("auto", "ddp", "fsdp")
LAUNCHER_PID = "AGENT_LOOP_LAUNCHER_PID"  # set by relaunch_under_torchrun: the process the workers die with
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher(poll_s: float = 1.0) -> None:
    """Make this worker process end when the process that started it (torchrun's agent) ends, however it ends,
    and write nothing after.

    Linux: the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); everywhere, as a backstop, a check of
    the parent pid before every write (``agent_loop.files.guard_writes``: a checkpoint or rollout file renamed
    into place, a metrics or rollout line appended) and a daemon thread that checks it every ``poll_s`` seconds.
    SIGKILL, not SIGTERM: with the launcher gone the run cannot go on, and a clean stop would wait on collectives
    with peers that are dying too; the checkpoints are written atomically (agent_loop/training/checkpoint.py), so the last
    complete one stays usable.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    # the launcher's pid when it said (relaunch_under_torchrun), else the parent now (plain torchrun)
    launcher = os.environ.get(LAUNCHER_PID, "")
    parent = int(launcher) if launcher.isdigit() else os.getppid()

    def stop_if_orphaned() -> None:
        if os.getppid() != parent:  # re-parented: the launcher is gone
            os.kill(os.getpid(), signal.SIGKILL)

    stop_if_orphaned()  # the launcher died before the signal was armed (torch's import takes seconds)
    files.guard_writes(stop_if_orphaned)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            stop_if_orphaned()

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


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


def resolve_parallel(parallel: str, device: torch.device, lora: bool = False) -> str:
    """``--parallel`` -> the wrapper: ``auto`` is ``fsdp`` on CUDA without LoRA, ``ddp`` otherwise."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if parallel == "auto":
        return "fsdp" if device.type == "cuda" and not lora else "ddp"
    return parallel


def _sum_hook(process_group, bucket):
    """DDP comm hook: the bucket's gradients summed over the ranks (DDP's default hook averages them)."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (a collective: every rank calls it in the same order); others as given."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with FSDP shards gathered into whole tensors (every rank must call it); names
    that share a parameter (tied embeddings) share the gathered tensor too."""
    def key(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape)

    gathered: dict[tuple, torch.Tensor] = {}
    state = module.state_dict()
    for tensor in state.values():
        if key(tensor) not in gathered:
            gathered[key(tensor)] = full_tensor(tensor)
    return {name: gathered[key(tensor)] for name, tensor in state.items()}


def _like(value, current):
    """A whole tensor ``value`` laid out like ``current`` (sharded the same way if it is a DTensor shard)."""
    if isinstance(current, DTensor) and isinstance(value, torch.Tensor) and value.shape == current.shape:
        return distribute_tensor(value.to(current.device, current.dtype), current.device_mesh, current.placements)
    return value


@torch.no_grad()
def load_full_state_dict_(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``module.load_state_dict(state)`` with whole tensors, into a module that may be sharded by FSDP."""
    current = module.state_dict()
    module.load_state_dict({name: _like(value, current.get(name)) for name, value in state.items()})


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with FSDP-sharded state (AdamW's moments) gathered: the state dict of the
    same optimizer over unsharded parameters, loadable in any number of ranks (every rank must call it)."""
    state = optimizer.state_dict()
    state["state"] = {index: {name: full_tensor(value) for name, value in entry.items()}
                      for index, entry in state["state"].items()}
    return state


def load_full_optimizer_state_(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load ``full_optimizer_state``'s (or a plain optimizer's) state dict into ``optimizer``, sharding the
    state of FSDP-sharded parameters like the parameters."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            entry = optimizer.state.get(parameter, {})
            for name, value in entry.items():
                entry[name] = _like(value, parameter)


@dataclass
class DataParallel:
    """This process's place in the data-parallel group (``world_size`` 1: no group, every method a no-op)
    and its wrapper, ``mode`` ``ddp`` or ``fsdp``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mode: str = "ddp"

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
        """``(rank, world_size)``, the ``shard`` argument of ``agent_loop.training.policy.micro_batches``."""
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

    def wrap(self, policy: nn.Module, device: torch.device) -> nn.Module:
        """``policy`` (a ``agent_loop.training.policy.PolicyModel``) in this group's wrapper; itself with one process.

        ``fsdp`` shards ``policy`` in place (its parameters become DTensor shards): take the trained
        parameters for the optimizer from it after this call."""
        if not self.enabled:
            return policy
        if self.mode == "fsdp":
            if hasattr(policy.model, "peft_config"):
                raise ValueError("--parallel fsdp does not shard LoRA models; use --parallel ddp (only the "
                                 "adapters are trained)")
            layer_types = set(getattr(policy.model, "_no_split_modules", None) or ())
            layers = [module for module in policy.model.modules() if type(module).__name__ in layer_types]
            if not layers:
                raise ValueError(f"--parallel fsdp: no decoder layers ({sorted(layer_types)}) found in "
                                 f"{type(policy.model).__name__}; use --parallel ddp")
            # no shared-prompt cache: its keys and values carry gradient back into the layers' k/v
            # projections around the layers' outputs, where FSDP2 hooks its re-gather, so their backward
            # would find the parameters resharded ("setStorage ... storage of size 0")
            policy.share_prefix = False
            for module in (*layers, policy):
                fully_shard(module)
                module.set_gradient_divide_factor(1.0)  # sum: the loss weights already divide by the mini-batch,
                module.set_force_sum_reduction_for_comms(True)  # as a plain SUM (gloo has no PREMUL_SUM)
            return policy
        wrapped = nn.parallel.DistributedDataParallel(
            policy, device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False)  # no collective in forward: scoring may call it without a backward
        wrapped.register_comm_hook(None, _sum_hook)
        return wrapped

    def accumulate(self, model: nn.Module, sync: bool):
        """Context for one micro-batch's forward and backward: gradients stay local (accumulate) unless
        ``sync``, the rank's last micro-batch of the mini-batch, when the wrapper reduces them."""
        if not self.enabled:
            return contextlib.nullcontext()
        if self.mode == "fsdp":
            model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else model.no_sync()

    def broadcast_object(self, value):
        """Rank 0's ``value`` on every rank."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def check_replicas_equal(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Raise RuntimeError if the ranks' parameters differ (compares float64 checksums; host sync).
        FSDP's parameters are shards, not replicas: nothing to compare."""
        if not self.enabled or self.mode == "fsdp":
            return
        with torch.no_grad():
            local = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in parameters])
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        for rank, part in enumerate(parts[1:], start=1):
            if not torch.equal(part, parts[0]):
                raise RuntimeError(f"data-parallel replicas diverged: rank {rank}'s parameters differ from rank 0's")


def init_data_parallel(device: str = "auto", parallel: str = "auto", lora: bool = False) -> DataParallel:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``),
    NCCL for CUDA and gloo for CPU; a single process (no ``WORLD_SIZE`` or 1) joins nothing."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device, local_rank)
    mode, cuda = resolve_parallel(parallel, resolved, lora), resolved.type == "cuda"
    if world_size <= 1:
        return DataParallel(mode=mode)
    rank = int(os.environ["RANK"])
    die_with_launcher()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    return DataParallel(rank=rank, world_size=world_size, local_rank=local_rank, mode=mode)


def close_data_parallel() -> None:
    """Destroy the process group. Call it once nothing holds a DDP wrapper (``agent_loop.cli.train.train`` drops
    its trainer first): a reducer freed after it ends the group with the GIL held, which can deadlock (pytorch#56297)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``python -m agent_loop.recipes ARGV`` in ``nproc`` processes on this machine (torchrun's standalone rendezvous);
    returns 0, or raises torchrun's ChildFailedError naming the failed rank."""
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
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers' parent is this process (torchrun runs in it)
    torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "agent_loop.recipes", *rest])
    return 0


class NullLogger:
    """The metrics logger of ranks other than 0: writes nothing."""

    def __init__(self, path):
        self.path = path

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass
