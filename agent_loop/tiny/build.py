"""Build and cache the tiny agent: tokenizer, warm-started model (stages "mid" and "final"), evaluation.

Cache: ``$AGENT_LOOP_CACHE`` or ``~/.cache/agent_loop``, folder ``tiny-agent-<RECIPE_VERSION>``
holding ``final/`` and ``mid/`` (each loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` and
vLLM) and ``build.json`` (timings and evaluation). A build runs in a temporary folder renamed into
place at the end, so an interrupted build leaves no broken cache, under a file lock, so two
processes never build at once.

Shipped builds: the repository ships the builds of this recipe (``agent_loop/tiny/weights/<folder>.tar.xz``,
checked against :data:`SHIPPED_SHA256`), so first use unpacks them in a second instead of training for
minutes, and every machine gets the same weights. ``agent-loop tiny --force`` rebuilds from the recipe
(:data:`RECIPE`, ``agent_loop.training.tiny_agent.build_recipe``: it trains with the library's loop), in a
child process with pinned numerics (``agent_loop.tiny.pinned``: AVX2 kernels, 2 threads), so that any x86-64
CPU with AVX2 trains the same bits; tests/tiny/test_shipped.py checks that a build here still behaves like
the shipped one (and says whether it is bit-identical).

Environment: ``AGENT_LOOP_CACHE`` (cache root), ``AGENT_LOOP_TINY_THREADS`` (torch threads for the
build; default 2: other counts may change the bits), ``AGENT_LOOP_TINY_STEPS`` (a shorter or longer
training, for experiments; it gets its own cache folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Callable

import torch
from transformers import GenerationConfig

import agent_loop.files as files
from agent_loop.tiny.pinned import run_pinned
from masking.cache import cache_root

# Change whenever anything that shapes the built files changes (it names the cache folder).
# v9: pinned numerics (agent_loop.tiny.pinned) and "mid" picked from every 2% of the second half of training
RECIPE_VERSION = "v9"
RECIPE = "agent_loop.training.tiny_agent:build_recipe"  # the recipe, run by name (agent_loop.tiny.pinned.run_pinned)
STAGES = ("mid", "final")
TRAIN_STEPS = 1000
# "mid": of the checkpoints at these fractions of training, the one whose sampled success on a quick
# check is closest to MID_TARGET (a middling start for RL). Copying the expression is learned late and
# suddenly, at a step that moves with the CPU's rounding (BENCHMARKS.md, "Tiny agent build"), so the
# candidates cover the whole second half: wherever the jump falls, one of them sits near the target.
MID_FRACTIONS = tuple(round(0.5 + 0.02 * i, 2) for i in range(25))
MID_TARGET, MID_CHECK_EPISODES, MID_CHECK_SEED = 0.45, 64, 404
SHIPPED_DIR = Path(__file__).parent / "weights"
SHIPPED_SHA256 = {  # cache folder name -> sha256 of its shipped archive (made by scripts/ship_tiny_agent.sh)
    "tiny-agent-v9": "1f3f160918de80562924dcdc906feb33d59aed80b12f39576f602c71b9a4793b",
    "tiny-agent-v9-chain": "4ee28a5ccaf1c84ae609e6ecc2409cffd9820d869bf77db20517ad909a9c0252",
}
TOKENIZER_DIALOGUES = 3000
TOKENIZER_SEED, TRAIN_SEED = 101, 202
EVAL_SEED, EVAL_EPISODES = 303, {"arithmetic": 100, "lookup": 50}


def train_steps() -> int:
    return int(os.environ.get("AGENT_LOOP_TINY_STEPS", TRAIN_STEPS))


def build_dir() -> Path:
    suffix = "" if train_steps() == TRAIN_STEPS else f"-steps{train_steps()}"
    return cache_root() / f"tiny-agent-{RECIPE_VERSION}{suffix}"


def tiny_agent_path(stage: str = "final") -> Path:
    """Folder of the tiny agent (tokenizer and model) at ``stage`` ("final" or "mid"); on first use unpacks the
    shipped build (or builds it, where none is shipped)."""
    return cached_stage(build_dir(), stage, lambda folder: _build_into(folder, True))


def cached_stage(target: Path, stage: str, build_into: Callable[[Path], dict]) -> Path:
    """``target / stage`` (``stage`` one of STAGES); on first use ``target`` is built by ``build`` with
    ``build_into``, under the build lock, so concurrent callers build it once."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {STAGES}")
    if not target.exists():
        with build_lock(target):
            if not target.exists() and not unpack_shipped(target):
                build(target, build_into=build_into)
    return target / stage


def shipped_archive(name: str) -> Path | None:
    """The shipped archive of the cache folder ``name``, or None if the repository ships none."""
    return SHIPPED_DIR / f"{name}.tar.xz" if name in SHIPPED_SHA256 else None


def unpack_shipped(target: Path) -> bool:
    """Unpack the shipped build of ``target`` (the caller holds the build lock) into place; False if none is
    shipped. RuntimeError if the archive is not the one :data:`SHIPPED_SHA256` names (a damaged checkout)."""
    archive = shipped_archive(target.name)
    if archive is None:
        return False
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SHIPPED_SHA256[target.name]:
        raise RuntimeError(f"{archive} is damaged (sha256 {digest}, expected {SHIPPED_SHA256[target.name]}); "
                           "restore it from git, or delete it to build the tiny agent from its recipe")
    with files.staging_folder(target) as scratch:
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        (scratch / target.name / "shipped.txt").write_text(f"unpacked from {archive.name}, sha256 {digest}\n")
        files.publish_folder(scratch / target.name, target)
    return True


build_lock = files.build_lock  # the one build lock (agent_loop.files); the tests and benchmarks take it from here too


def build(target: Path, progress: bool = True, *, build_into: Callable[[Path], dict] | None = None) -> dict:
    """Build everything into a temporary sibling of ``target`` (the default tiny agent, or ``build_into(folder)``),
    then rename it to ``target``.

    Replaces an existing ``target`` (the caller holds the lock). Returns the build record.
    """
    threads = torch.get_num_threads()  # an unpinned build (agent_loop.tiny.pinned) sets them in this process
    try:  # the caller holds the lock: a scratch folder left by a killed build is ours to remove
        return files.write_folder(target, build_into or (lambda scratch: _build_into(scratch, progress)))
    finally:
        torch.set_num_threads(threads)


def _build_into(folder: Path, progress: bool) -> dict:
    run_pinned(RECIPE, str(folder), "1" if progress else "")
    return json.loads((folder / "build.json").read_text())


def save_model(folder: Path, model, tokenizer) -> None:
    """Save ``model`` and ``tokenizer`` into ``folder``, with a generation config that stops at the end of a turn."""
    model.generation_config = GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_record() -> dict:
    """The record of the cached build (builds it first if missing)."""
    tiny_agent_path()
    return json.loads((build_dir() / "build.json").read_text())
