"""LoRA training through peft (agent_loop/training/lora.py) on the real tiny agent.

Checks: only the adapter matrices get gradients and move, the frozen base stays bit-identical; the
rollout backend gets the merged weights; the saved checkpoint is a plain transformers model equal to
base + (alpha / r) B A computed here from the adapter's own matrices, and it gives the LoRA model's
logits; a LoRA run resumes from its checkpoint to the straight run's next step.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_loop import TrainConfig, Trainer
from agent_loop.training.checkpoint import step_folder
from tests.helpers.trainer_config import batch_of

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0


def lora_config(tiny_mid, tmp_path, **overrides) -> TrainConfig:
    settings = dict(model=tiny_mid, steps=1, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=2,
                    micro_batch_size=4, lr=1e-2, entropy_coef=0.01, kl_coef=0.05, lora_rank=RANK,
                    lora_alpha=ALPHA, threads=1, save_every=1, output_dir=str(tmp_path / "run"), progress=False)
    settings.update(overrides)
    return TrainConfig.from_flat(**settings)


def test_lora_trains_adapters_only_and_saves_base_plus_adapter(tiny_mid, tmp_path):
    trainer = Trainer(lora_config(tiny_mid, tmp_path))
    named = dict(trainer.policy.named_parameters())
    adapters = {n for n in named if "lora_" in n}
    assert adapters and {n for n, p in named.items() if p.requires_grad} == adapters
    assert {id(p) for p in trainer.trained_parameters} == {id(named[n]) for n in adapters}
    before = {n: p.detach().clone() for n, p in named.items()}

    # one mini-batch's gradient: on the adapters only
    batch = batch_of(trainer, trainer.rollouts.play_groups(0))
    trainer.ppo.score(batch)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss, _ = trainer.ppo.micro_batch_loss(batch)
    loss.backward()
    with_grad = {n for n, p in named.items() if p.grad is not None}
    assert with_grad == adapters
    assert all(named[n].grad.abs().sum() > 0 for n in adapters if "lora_B" in n)  # B = 0 at start: A gets none yet
    trainer.optimizer.zero_grad(set_to_none=True)

    trainer.train()
    for name, value in named.items():
        if name in adapters:
            continue
        assert torch.equal(value, before[name]), f"frozen {name} moved"
    assert any(not torch.equal(named[n], before[n]) for n in adapters if "lora_B" in n)

    # the checkpoint: plain transformers weights = base + (alpha / r) B A, from the adapter's own matrices
    saved = AutoModelForCausalLM.from_pretrained(step_folder(trainer.output_dir, 1) / "model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_mid, dtype=torch.float32).state_dict()
    merged_layers = 0
    for name, value in saved.state_dict().items():
        a_name = next((n for n in adapters if n.endswith(name.replace(".weight", ".lora_A.default.weight"))), None)
        if a_name is None:
            torch.testing.assert_close(value, base[name], atol=0, rtol=0, msg=name)
            continue
        a, b = named[a_name].detach(), named[a_name.replace("lora_A", "lora_B")].detach()
        torch.testing.assert_close(value, base[name] + (ALPHA / RANK) * b @ a, atol=1e-6, rtol=0, msg=name)
        merged_layers += 1
    assert merged_layers == 4 * 7  # every linear layer of the 4 decoder blocks
    assert (step_folder(trainer.output_dir, 1) / "adapter" / "adapter_config.json").exists()

    # the merged model computes what the LoRA model computes, and the rollout backend holds it
    ids = torch.tensor([batch["input_ids"][0].tolist()])
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, trainer.policy(input_ids=ids).logits, atol=1e-4, rtol=0)
    for name, value in trainer.backend.model.state_dict().items():
        torch.testing.assert_close(value, saved.state_dict()[name], atol=1e-6, rtol=0, msg=name)


def test_lora_run_resumes_from_its_checkpoint(tiny_mid, tmp_path):
    config = lora_config(tiny_mid, tmp_path, steps=2)
    straight = Trainer(config)
    history = straight.train()
    resumed = Trainer(config.replace(resume=str(step_folder(straight.output_dir, 1)),
                                     output_dir=str(tmp_path / "resumed")))
    assert resumed.step == 1
    metrics = resumed.train_step()
    assert metrics["loss/first"] == pytest.approx(history[1]["loss/first"], abs=1e-6)
    for (name, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
