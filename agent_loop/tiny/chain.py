"""The tiny agent for the ``chain`` task (issue 17): the default tiny agent, trained further on chain dialogues.

``chain_agent_path(stage)`` returns the folder, cached on first use: unpacked from the shipped archive
(``agent_loop/tiny/weights/tiny-agent-<RECIPE_VERSION>-chain.tar.xz``, checked against
``agent_loop.tiny.build.SHIPPED_SHA256``), so every machine gets the same weights, or built from the recipe
below, with pinned numerics (``agent_loop.tiny.pinned``), where none is shipped (its build time is in
BENCHMARKS.md). The default tiny agent stays as it is.

Recipe: start from the default tiny agent's "final" stage (it calls ``calculator`` and ``lookup``) and
continue its warm start (``agent_loop.tiny.train``) on a mix of chain dialogues (CHAIN_SHARE) and the
default mix (arithmetic and lookup), in two phases (PHASES: steps and peak learning rate; each warms
up and decays as the default recipe does). Two stages are kept:

- ``final``: the end of training;
- ``mid``: of the checkpoints at MID_STEPS of the last phase, the one whose sampled chain success on a
  quick check is closest to MID_TARGET: a start that succeeds sometimes, so RL has room.

Cache: ``<cache root>/tiny-agent-<RECIPE_VERSION>-chain/{mid,final,build.json}``, built in a temporary
folder and renamed into place under the same file lock as the default build (``agent_loop.tiny.build``).
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loop.tiny.build import RECIPE_VERSION, cached_stage, save_model, tiny_agent_path
from agent_loop.tiny.data import task_for
from agent_loop.tiny.evaluate import evaluate
from agent_loop.tiny.pinned import numerics, run_pinned
from agent_loop.tiny.train import train
from masking.native import cache_root

# the first phase's peak (the default recipe's) costs the copying skills for a while; the second, gentler,
# brings the chain's copies (the value into the lookup, the code into the answer) up
PHASES = ((150, 3e-3), (100, 1e-3))
CHAIN_SHARE = 0.6  # the rest: the default mix, so the agent keeps its arithmetic and lookup
CHAIN_SEED = 505
MID_STEPS, MID_TARGET, MID_CHECK_EPISODES, MID_CHECK_SEED = (25, 50, 75, 100), 0.35, 32, 606
EVAL_SEED, EVAL_EPISODES = 707, 48


def chain_build_dir() -> Path:
    return cache_root() / f"tiny-agent-{RECIPE_VERSION}-chain"


def chain_agent_path(stage: str = "mid") -> Path:
    """Folder of the chain-trained tiny agent at ``stage`` ("mid" or "final"); builds it on first use."""
    return cached_stage(chain_build_dir(), stage, lambda folder: _build_into(folder, tiny_agent_path("final"), True))


def chain_task_for(index: int, seed: int) -> str:
    """Which task dialogue ``index`` of the chain stage's training stream is (deterministic)."""
    return "chain" if random.Random(f"chain-mix:{seed}:{index}").random() < CHAIN_SHARE else task_for(index, seed)


def _build_into(folder: Path, base: Path, progress: bool) -> dict:
    run_pinned(recipe, str(folder), str(base), "1" if progress else "")
    return json.loads((folder / "build.json").read_text())


def recipe(folder: str, base: str, progress: str) -> None:
    """The chain stage's recipe (run by :func:`agent_loop.tiny.pinned.run_pinned`), from the model in ``base``,
    into ``folder`` with its ``build.json``."""
    folder, base, progress, started = Path(folder), Path(base), bool(progress), time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the base as "<cache folder>/<stage>", not an absolute path: the build is shipped
    record: dict = {"recipe": f"{RECIPE_VERSION}-chain", "base": f"{base.parent.name}/{base.name}", "phases": PHASES,
                    "numerics": numerics(), "stages": {}, "mid_candidates": {}}
    mid: dict = {}

    def consider_mid(step: int, model) -> None:
        step += sum(steps for steps, _ in PHASES[:-1])  # counted from the start of the chain stage
        check = evaluate(model, tokenizer, "chain", MID_CHECK_EPISODES, MID_CHECK_SEED, greedy=False)
        success = check["success"]
        record["mid_candidates"][step] = {"success": success, "right_first_call": check["right_arguments"]}
        if progress:
            print(f"chain stage, step {step}: sampled chain success {success:.3f}, "
                  f"right first call {check['right_arguments']:.3f}", flush=True)
        if not mid or abs(success - MID_TARGET) < abs(mid["success"] - MID_TARGET):
            mid.update(step=step, success=success, state=copy.deepcopy(model.state_dict()))

    def save(stage: str, step: int) -> None:
        save_model(folder / stage, model, tokenizer)
        record["stages"][stage] = {"step": step, "eval": [
            evaluate(model, tokenizer, "chain", EVAL_EPISODES, EVAL_SEED, greedy) for greedy in (True, False)]}

    for phase, (steps, peak_lr) in enumerate(PHASES):
        last = phase == len(PHASES) - 1
        train(tokenizer, steps, CHAIN_SEED + phase, MID_STEPS if last else (), consider_mid, progress, model=model,
              tasks=chain_task_for, peak_lr=peak_lr, description=f"training the tiny agent on chain dialogues ({phase + 1})")
    save("final", sum(steps for steps, _ in PHASES))
    model.load_state_dict(mid["state"])
    save("mid", mid["step"])
    record["build_seconds"] = time.perf_counter() - started
    (folder / "build.json").write_text(json.dumps(record, indent=2))


def chain_build_record() -> dict:
    """The record of the cached chain build (builds it first if missing)."""
    chain_agent_path()
    return json.loads((chain_build_dir() / "build.json").read_text())
