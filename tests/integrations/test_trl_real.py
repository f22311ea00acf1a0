"""examples/trl_grpo_tools.py with the real installed TRL (side environment .side-envs/trl, built by
``bash scripts/side_env.sh trl``; scripts/setup.sh --test builds it): 2 GRPOTrainer steps with tools,
our spans and REINFORCE++ advantages in TRL's loss, checked against the serial reference."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.reference_returns import ASSISTANT, discounted_returns_ref, whiten_ref
from tests.helpers.trl_reference import from_trl_batch_ref

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".side-envs" / "trl" / "bin" / "python"
GAMMA = 1.0  # the example's default (docs/trl.md: below 1, per-batch whitening can flip a wrong answer's sign)


def run_example(*argv: str) -> dict:
    if not SIDE_PYTHON.exists():
        pytest.fail(f"no TRL side environment at {SIDE_PYTHON}: build it with `bash scripts/side_env.sh trl` "
                    "(scripts/setup.sh --test does)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run([str(SIDE_PYTHON), str(ROOT / "examples" / "trl_grpo_tools.py"), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    assert done.returncode == 0, f"the example failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("AGENT_LOOP_TRL_RESULT ")]
    assert lines, f"no AGENT_LOOP_TRL_RESULT line in the output:\n{done.stdout[-3000:]}"
    result = json.loads(lines[-1].split(" ", 1)[1])
    print(f"TRL example: {wall:.0f} s wall, {result['seconds']} s in-process", file=sys.stderr)
    return result


@pytest.fixture(scope="module")
def trl_run() -> dict:
    return run_example()


@pytest.mark.integration
@pytest.mark.slow
def test_gigpo_trains_a_step_in_trl_on_the_tool_turns():
    """SpanGRPOTrainer with a turn-level estimator (issue 47): gigpo gets TRL's completion ids (its anchor states
    are the tool results' tokens) and the group ids, and its advantages are what TRL's loss saw."""
    from agent_loop.integrations.trl import trl_advantages

    run = run_example("--estimator", "gigpo", "--steps", "1")
    assert run["trl_steps"] == 1 and all(math.isfinite(loss) for loss in run["losses"])
    batch = run["first_batch"]
    assert batch["index"] == [row // 2 for row in range(len(batch["rewards"]))]  # num_generations 2
    want, spans, _ = trl_advantages(torch.tensor(batch["completion_mask"]), torch.tensor(batch["tool_mask"]),
                                    torch.tensor(batch["rewards"]), estimator="gigpo", index=torch.tensor(batch["index"]),
                                    masked="drop", responses=torch.tensor(batch["completion_ids"]))
    assert batch["spans"] == spans.tolist()
    torch.testing.assert_close(torch.tensor(batch["advantages"]), want)
    for check in run["checks"]:
        assert check["trl_loss_mask_equals_spans"] and check["max_abs_advantage_off_assistant"] == 0.0
        assert check["loss"] == pytest.approx(check["loss_from_advantages"], abs=1e-6)


@pytest.mark.integration
@pytest.mark.slow
def test_the_example_trains_two_steps_with_tools_in_trl(trl_run):
    assert trl_run["trl_steps"] == 2
    assert trl_run["seconds"] < 180, f"the example took {trl_run['seconds']} s (budget: 3 minutes)"
    assert all(math.isfinite(loss) for loss in trl_run["losses"]) and len(trl_run["losses"]) == 2
    assert all(norm > 0 for norm in trl_run["grad_norms"]), trl_run["grad_norms"]  # our advantages move the model
    assert trl_run["tool_calls"] == [1.0, 1.0]  # TRL's tool loop called the calculator in every rollout
    # the 12-5 question's answer is truncated, TRL masks its 2 rollouts; their 0.5 tool reward is dropped, counted
    assert trl_run["dropped_rewards"] == [2.0, 2.0]


@pytest.mark.integration
@pytest.mark.slow
def test_trl_loss_saw_our_advantages_on_our_spans(trl_run):
    assert len(trl_run["checks"]) == 2
    for check in trl_run["checks"]:
        assert len(check["advantages_shape"]) == 2  # (b, t) advantages in TRL's own loss input
        assert check["trl_loss_mask_equals_spans"]  # TRL's completion_mask * tool_mask == our ASSISTANT tokens
        assert check["tool_tokens"] > 0 and check["masked_rows"] == 2
        assert check["nonzero_advantages_on_assistant"] == check["assistant_tokens"] > 0
        assert check["max_abs_advantage_off_assistant"] == 0.0  # exactly 0 on tool results and padding
        assert check["loss"] == pytest.approx(check["loss_from_advantages"], abs=1e-6)


@pytest.mark.integration
@pytest.mark.slow
def test_trl_batch_advantages_equal_the_serial_reference(trl_run):
    batch = trl_run["first_batch"]
    spans, token_rewards = from_trl_batch_ref(batch["completion_mask"], batch["tool_mask"], batch["rewards"], "drop")
    assert batch["spans"] == spans
    assert sum(kind != ASSISTANT and kind != 0 for row in spans for kind in row) > 0  # tool tokens are there
    expected = whiten_ref(discounted_returns_ref(token_rewards, spans, GAMMA), spans)
    torch.testing.assert_close(torch.tensor(batch["advantages"], dtype=torch.float64), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.integration
@pytest.mark.slow
def test_trl_batch_advantages_have_the_sign_of_the_answer(trl_run):
    """gamma 1: each row's advantage is one number on all its ASSISTANT tokens, ordered as the rewards, so a
    wrong answer (the lower reward) is never reinforced on any token, a right one on every token."""
    batch = trl_run["first_batch"]
    per_row = {}
    for spans, advantages, reward in zip(batch["spans"], batch["advantages"], batch["rewards"]):
        values = {round(a, 5) for a, kind in zip(advantages, spans) if kind == ASSISTANT}
        if values:  # a masked (truncated) row has none
            assert len(values) == 1, values
            per_row.setdefault(reward, set()).update(values)
    assert len(per_row) == 2, per_row  # right and wrong answers both in the batch (the steering's half and half)
    (low, low_values), (high, high_values) = sorted(per_row.items())
    assert max(low_values) < 0 < min(high_values), per_row
