"""The tiny agent for the ``chain`` task (issue 17): the default tiny agent, trained further on chain dialogues.

``chain_agent_path(stage)`` returns the folder, cached on first use: unpacked from the shipped archive
(``agent_loop/tiny/weights/tiny-agent-<RECIPE_VERSION>-chain.tar.xz``, checked against
``agent_loop.tiny.build.SHIPPED_SHA256``), so every machine gets the same weights, or built from the recipe
(RECIPE, ``agent_loop.training.tiny_agent.chain_recipe``), with pinned numerics (``agent_loop.tiny.pinned``), where none is shipped (its build time is in
BENCHMARKS.md). The default tiny agent stays as it is.

Recipe: start from the default tiny agent's "final" stage (it calls ``calculator`` and ``lookup``) and
continue its warm start on a mix of chain dialogues (CHAIN_SHARE) and the
default mix (arithmetic and lookup), in two phases (PHASES: steps and peak learning rate; each warms
up and decays as the default recipe does). Two stages are kept:

- ``final``: the end of training;
- ``mid``: of the checkpoints at MID_STEPS of the last phase, the one whose sampled chain success on a
  quick check is closest to MID_TARGET: a start that succeeds sometimes, so RL has room.

Cache: ``<cache root>/tiny-agent-<RECIPE_VERSION>-chain/{mid,final,build.json}``, built in a temporary
folder and renamed into place under the same file lock as the default build (``agent_loop.tiny.build``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from agent_loop.tiny.build import RECIPE_VERSION, cached_stage, tiny_agent_path
from agent_loop.tiny.data import task_for
from agent_loop.tiny.pinned import run_pinned
from masking.native import cache_root

# the first phase's peak (the default recipe's) costs the copying skills for a while; the second, gentler,
# brings the chain's copies (the value into the lookup, the code into the answer) up
PHASES = ((150, 3e-3), (100, 1e-3))
CHAIN_SHARE = 0.6  # the rest: the default mix, so the agent keeps its arithmetic and lookup
CHAIN_SEED = 505
MID_STEPS, MID_TARGET, MID_CHECK_EPISODES, MID_CHECK_SEED = (25, 50, 75, 100), 0.35, 32, 606
EVAL_SEED, EVAL_EPISODES = 707, 48
RECIPE = "agent_loop.training.tiny_agent:chain_recipe"  # the recipe, run by name (agent_loop.tiny.pinned.run_pinned)


def chain_build_dir() -> Path:
    return cache_root() / f"tiny-agent-{RECIPE_VERSION}-chain"


def chain_agent_path(stage: str = "mid") -> Path:
    """Folder of the chain-trained tiny agent at ``stage`` ("mid" or "final"); builds it on first use."""
    return cached_stage(chain_build_dir(), stage, lambda folder: _build_into(folder, tiny_agent_path("final"), True))


def chain_task_for(index: int, seed: int) -> str:
    """Which task dialogue ``index`` of the chain stage's training stream is (deterministic)."""
    return "chain" if random.Random(f"chain-mix:{seed}:{index}").random() < CHAIN_SHARE else task_for(index, seed)


def _build_into(folder: Path, base: Path, progress: bool) -> dict:
    run_pinned(RECIPE, str(folder), str(base), "1" if progress else "")
    return json.loads((folder / "build.json").read_text())


def chain_build_record() -> dict:
    """The record of the cached chain build (builds it first if missing)."""
    chain_agent_path()
    return json.loads((chain_build_dir() / "build.json").read_text())
