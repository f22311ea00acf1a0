"""Golden runs: what a user's seeded run gives does not change when the code is reorganised (issue 55 item 6).

A 2-step ``agent-loop train`` on the tiny agent's middling warm start (rollouts -> batch -> advantages -> PPO
update -> checkpoint, with an evaluation) and a 2-step ``agent-loop warmstart`` on the tiny agent (demonstrations
-> fine-tune -> saved model -> held-out check), both through the command line in this process, give the
metrics and checkpoint tensors recorded in tests/data/golden/ to 1e-6.

The runs are deterministic on CPU with one torch thread (conftest.py sets OMP_NUM_THREADS=1; ``--threads 1``).
Metrics are compared without their wall-clock ones (``time/*``, ``*_per_s``), to 1e-6 (relative above 1). A
checkpoint's tensors (the model's weights; train's also AdamW's moments) are kept as a digest, ``tensor_digest``:
the mean, the root mean square, the change from the start model and the values at a few fixed positions,
each compared to 1e-6 of the tensor's root mean square (``assert_close``).

To re-record, only for a change of numbers that is intended (say so in the commit):

    AGENT_LOOP_RECORD_GOLDEN=1 .venv/bin/python -m pytest -q tests/training/test_golden.py -m slow

It writes tests/data/golden/{train,warmstart}.json from the code checked out (the first record: 84630b4).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent_loop.cli import main as agent_loop

GOLDEN = Path(__file__).parent.parent / "data" / "golden"
RECORD = os.environ.get("AGENT_LOOP_RECORD_GOLDEN") == "1"
TOLERANCE = 1e-6
SAMPLES = 8  # values kept of each tensor, at positions drawn once from a fixed seed

# 8 episodes a step (4 questions x 2 samples), 2 mini-batches of micro-batches of 2; KL and entropy terms so that
# the update moves the weights whatever the rewards; an evaluation and a checkpoint at step 2
TRAIN = ["train", "--model", "tiny-mid", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2",
         "--concurrency", "8", "--mini-batches", "2", "--micro-batch-size", "2", "--kl-coef", "0.05",
         "--entropy-coef", "0.01", "--eval-every", "2", "--eval-episodes", "4", "--save-every", "2",
         "--threads", "1", "--no-progress", "--no-tensorboard", "--seed", "0"]
# 8 demonstrations, batches of 4 in micro-batches of 2, and 2 held-out episodes sampled by the saved model
WARMSTART = ["warmstart", "--model", "tiny", "--steps", "2", "--episodes", "8", "--batch-size", "4",
             "--micro-batch-size", "2", "--check-episodes", "2", "--threads", "1", "--no-progress", "--seed", "0"]


def tensor_digest(tensor: torch.Tensor, start: torch.Tensor) -> dict:
    """Numbers that each move by at most 1e-6 x scale when no element of ``tensor`` does (in float64)."""
    values, change = tensor.double().flatten(), (tensor.double() - start.double()).flatten()
    positions = torch.randint(values.numel(), (SAMPLES,), generator=torch.Generator().manual_seed(values.numel()))
    return {"mean": values.mean().item(), "rms": values.square().mean().sqrt().item(),
            "change_mean_abs": change.abs().mean().item(), "change_rms": change.square().mean().sqrt().item(),
            "samples": values[positions].tolist()}


def weights_digest(model_dir: Path, start_dir: Path) -> dict:
    weights, start = load_file(model_dir / "model.safetensors"), load_file(start_dir / "model.safetensors")
    return {name: tensor_digest(weights[name], start[name]) for name in sorted(weights)}


def optimizer_digest(state_file: Path) -> dict:
    """AdamW's moments of each parameter (by its index), measured from zero: the state a resume goes on from."""
    state = torch.load(state_file, weights_only=False)["optimizer"]["state"]
    return {f"{index}/{key}": tensor_digest(moments[key], torch.zeros_like(moments[key]))
            for index, moments in sorted(state.items()) for key in ("exp_avg", "exp_avg_sq")}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics(path: Path) -> list[dict]:
    """Each step's metrics without the wall-clock ones."""
    return [{k: v for k, v in record.items() if not (k.startswith("time/") or k.endswith("_per_s"))}
            for record in read_jsonl(path)]


def assert_close(actual, expected, where: str = "", scale: float = 1.0) -> None:
    """Every recorded key still there (a metric may be added), strings and booleans equal, numbers within 1e-6 of
    ``max(|expected|, scale)``: the metrics' scale is 1 (1e-6 apart below 1), a tensor digest's the tensor's root
    mean square (moments of 1e-4 are compared at their own scale, not at an absolute 1e-6 that any value meets)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) <= set(actual), (where, sorted(set(expected) - set(actual)))
        scale = expected["rms"] if "samples" in expected else scale  # a tensor_digest
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}/{key}", scale)
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (where, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{where}[{i}]", scale)
    elif isinstance(expected, (int, float)) and not isinstance(expected, bool):
        assert isinstance(actual, (int, float)) and abs(actual - expected) <= TOLERANCE * max(abs(expected), scale), (
            where, actual, expected)
    else:
        assert actual == expected, (where, actual, expected)


def check_against_golden(name: str, result: dict) -> None:
    path = GOLDEN / f"{name}.json"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    assert_close(result, json.loads(path.read_text()), name)


@pytest.mark.slow
def test_a_two_step_train_gives_the_recorded_metrics_and_checkpoint(tmp_path, tiny_mid):
    out = tmp_path / "train"
    assert agent_loop([*TRAIN, "--output-dir", str(out)]) == 0
    checkpoint = out / "checkpoints" / "step_000002"
    result = {"command": TRAIN, "metrics": metrics(out / "metrics.jsonl"),
              "weights": weights_digest(checkpoint / "model", Path(tiny_mid)),
              "optimizer": optimizer_digest(checkpoint / "trainer_state.pt")}
    assert [m["step"] for m in result["metrics"]] == [0, 1, 2]  # step 0: the evaluation before training
    assert any(d["change_rms"] > 0 for d in result["weights"].values())  # the update moved the weights
    check_against_golden("train", result)


@pytest.mark.slow
def test_a_two_step_warmstart_gives_the_recorded_metrics_and_model(tmp_path, tiny_agent_dir):
    out = tmp_path / "warmstart"
    assert agent_loop([*WARMSTART, "--output-dir", str(out)]) == 0
    check = sorted(read_jsonl(out / "check.jsonl"), key=lambda episode: episode["info"]["index"])
    result = {"command": WARMSTART, "metrics": metrics(out / "metrics.jsonl"),
              "weights": weights_digest(out / "model", Path(tiny_agent_dir)),
              "check": [{"reward": e["reward"], "response_ids": e["response_ids"]} for e in check]}
    assert [m["step"] for m in result["metrics"]] == [1, 2] and len(result["check"]) == 2
    assert any(d["change_rms"] > 0 for d in result["weights"].values())
    check_against_golden("warmstart", result)
