"""examples/rl_step_by_hand.py, one RL step written out with the public API, is the step `agent-loop train` takes
with the same settings: the same weights after it, to 1e-6, and the same measurements (issue 55 item 5)."""

import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent_loop.cli import main as agent_loop

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_step_by_hand.py"


def recipe_argv(example: dict, output_dir: Path) -> list[str]:
    """``agent-loop train`` with the example's settings, one step, a checkpoint after it."""
    loop = [part for name, value in example["LOOP"].items() for part in (f"--{name.replace('_', '-')}", str(value))]
    n = str(example["EPISODES"])
    return ["train", "--model", example["MODEL"], "--task", example["TASK"], "--seed", str(example["SEED"]),
            "--steps", "1", "--prompts-per-step", n, "--group-size", "1", "--concurrency", n, "--mini-batches", "1",
            "--micro-batch-size", n, "--ppo-epochs", "1", "--estimator", "reinforce_plus_plus",
            "--gamma", str(example["GAMMA"]), "--lr", str(example["LR"]), "--warmup-steps", "0",
            "--clip-ratio", str(example["CLIP_RATIO"]), "--max-grad-norm", str(example["MAX_GRAD_NORM"]), *loop,
            "--backend", "hf", "--threads", "1", "--save-every", "1", "--no-progress", "--no-tensorboard",
            "--output-dir", str(output_dir)]


@pytest.mark.slow
def test_the_step_by_hand_is_the_recipes_step(tmp_path, tiny_mid):
    example = runpy.run_path(str(EXAMPLE))
    policy, metrics = example["main"]()
    assert agent_loop(recipe_argv(example, tmp_path / "train")) == 0

    recipe = load_file(tmp_path / "train" / "checkpoints" / "step_000001" / "model" / "model.safetensors")
    start = load_file(Path(tiny_mid) / "model.safetensors")
    mine = policy.state_dict()
    for name, weights in recipe.items():
        torch.testing.assert_close(mine[name], weights, atol=1e-6, rtol=0, msg=name)
    moved = max((weights - start[name]).abs().max().item() for name, weights in recipe.items())
    assert moved > 5e-6  # the step moved weights by about --lr (1e-5), more than the tolerance

    (logged,) = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["success"] == logged["success"]
    for name in ("loss", "grad_norm", "clip_frac"):
        assert metrics[name] == pytest.approx(logged[name], abs=1e-6), name
