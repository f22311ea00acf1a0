"""The sampler/trainer mismatch correction in the trainer (``--rollout-is``, ``--rollout-rs``) on the real tiny
agent and real rollouts: a step's weighted PPO loss equals a hand-computed serial reference (each trajectory
through the model alone, a loop over its tokens), the mismatch metrics reach metrics.jsonl and TensorBoard,
a step whose every token is rejected leaves the weights alone, bad settings are refused in one line, and the
micro-batches carry the sampler's logprobs and the weights.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from agent_loop import TrainConfig, Trainer
from agent_loop.cli.train import main as train_main
from agent_loop.options import checked
from agent_loop.training.policy import micro_batches
from agent_loop.training.ppo import PPO
from masking import SpanKind
from tests.helpers.reference_losses import ppo_token_loss
from tests.helpers.trainer_config import batch_of, random_advantages, small_config
from tests.helpers.trajectories import collate_rows, random_trajectory

ASSISTANT = SpanKind.ASSISTANT
MISMATCH_KEYS = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ratio_mean", "mismatch/ratio_min", "mismatch/ratio_max",
                 "mismatch/ratio_p05", "mismatch/ratio_p50", "mismatch/ratio_p95", "mismatch/frac_capped",
                 "mismatch/frac_masked")
CAP, LOWER, UPPER = 1.1, 0.8, 1.25


def serial_logprobs(model, trajectories) -> dict[tuple[int, int], float]:
    """``(row, position) -> logprob`` of every ASSISTANT token, each trajectory unpadded through ``model`` alone."""
    found = {}
    with torch.no_grad():
        for row, trajectory in enumerate(trajectories):
            ids = trajectory.prompt_ids + trajectory.response_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            p = len(trajectory.prompt_ids)
            for j, token in enumerate(trajectory.response_ids):
                if trajectory.spans[j] == ASSISTANT:
                    found[row, j] = float(logprobs[p + j - 1, token])
    return found


def reference_weighted_loss(new, old, rollout, advantages, clip_ratio) -> tuple[float, int, int]:
    """Token-level TIS (cap CAP) and rejection outside [LOWER, UPPER] on rho = exp(old - rollout), composed
    with PPO's clip: ``sum over kept tokens of min(rho, CAP) * ppo_t`` / kept tokens, ppo_t the dual-clip PPO
    term (``reference_losses.ppo_token_loss``). Returns (loss, kept tokens, capped tokens)."""
    total, kept, capped = 0.0, 0, 0
    for (row, j), old_logprob in old.items():
        rho = math.exp(old_logprob - float(rollout[row, j]))
        capped += rho > CAP
        if not LOWER <= rho <= UPPER:
            continue
        ratio, a = math.exp(new[row, j] - old_logprob), float(advantages[row, j])
        total += min(rho, CAP) * ppo_token_loss(ratio, a, clip_ratio, clip_ratio)
        kept += 1
    return total / kept, kept, capped


@pytest.mark.slow
def test_a_step_with_correction_equals_the_hand_computed_weighted_loss(tiny_mid, tmp_path):
    trainer = Trainer(small_config(tiny_mid, tmp_path, mini_batches=1, lr=1e-2, rollout_is="token",
                                   rollout_is_threshold=CAP, rollout_rs="token", rollout_rs_lower=LOWER,
                                   rollout_rs_upper=UPPER))
    trajectories = trainer.rollouts.play_groups(0)
    batch = batch_of(trainer, trajectories)
    # a sampler that disagrees with the trainer: its logprobs moved by noise on the ASSISTANT tokens
    noise = 0.15 * torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(0))
    batch.rollout_logprobs = torch.where(batch.spans == ASSISTANT, batch.rollout_logprobs + noise, 0.0)
    rollout = batch.rollout_logprobs.clone()
    old = serial_logprobs(trainer.policy, trajectories)
    metrics = trainer.ppo.score(batch)
    random_advantages(batch)

    # before the update the PPO ratio is 1: the first loss is the weighted policy gradient alone
    first, kept, capped = reference_weighted_loss(old, old, rollout, batch.advantages, trainer.config.update.clip_ratio)
    assert 0 < kept < len(old) and capped > 0  # the cap and the rejection both act on this batch
    assert metrics["mismatch/frac_masked"] == pytest.approx(1 - kept / len(old))
    assert metrics["mismatch/frac_capped"] == pytest.approx(capped / len(old))
    assert batch.loss_mask.sum() == kept  # the loss's tokens; the batch's response mask stays every ASSISTANT token
    assert torch.equal(batch.response_mask, (batch.spans == ASSISTANT).to(batch.response_mask.dtype))
    update = trainer.ppo.update(batch, step=0)  # one large AdamW step: the ratios move and some get clipped
    assert update["loss/first"] == pytest.approx(first, abs=1e-5)

    loss, stats = trainer.ppo.micro_batch_loss(batch)
    expected, _, _ = reference_weighted_loss(serial_logprobs(trainer.policy, trajectories), old, rollout,
                                             batch.advantages, trainer.config.update.clip_ratio)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert float(stats["clip_frac"]) > 0


@pytest.mark.slow
def test_mismatch_metrics_reach_metrics_jsonl_and_tensorboard(tiny_mid, tmp_path):
    out = tmp_path / "cli"
    status = train_main(["--model", tiny_mid, "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                         "--mini-batches", "1", "--output-dir", str(out), "--no-progress", "--rollout-is", "sequence",
                         "--rollout-is-threshold", "3", "--rollout-rs", "token", "--rollout-rs-lower", "0.5"])
    assert status == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in MISMATCH_KEYS:
            assert math.isfinite(record[key]), (key, record.get(key))
        # the transformers sampler in fp32 and the trainer agree to float rounding: ratios ~ 1, nothing corrected
        assert record["mismatch/ratio_min"] <= record["mismatch/ratio_p05"] <= record["mismatch/ratio_p50"]
        assert record["mismatch/ratio_p50"] <= record["mismatch/ratio_p95"] <= record["mismatch/ratio_max"]
        assert abs(record["mismatch/ratio_p50"] - 1) < 1e-4 and abs(record["mismatch/kl_k1"]) < 1e-4
        assert 0 <= record["mismatch/kl_k3"] < 1e-6
        assert record["mismatch/frac_capped"] == 0 and record["mismatch/frac_masked"] == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in MISMATCH_KEYS:
        assert [(s.step, s.value) for s in events.Scalars(key)] == [
            (r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-12)) for r in records], key


@pytest.mark.slow
def test_a_step_whose_every_token_is_rejected_leaves_the_weights_alone(tiny_mid, tmp_path):
    # fp32 sampler and trainer agree: every ratio is ~1, outside [1.5, 2]
    trainer = Trainer(small_config(tiny_mid, tmp_path, rollout_rs="sequence", rollout_rs_lower=1.5, entropy_coef=0.01))
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    with pytest.warns(UserWarning, match="rejected every ASSISTANT token"):
        metrics = trainer.train_step()
    assert metrics["mismatch/frac_masked"] == 1.0 and metrics["skipped_updates"] == 1.0
    assert math.isnan(metrics["loss"])
    assert all(torch.equal(p, q) for p, q in zip(trainer.policy.parameters(), before))
    assert trainer.step == 1


def test_bad_correction_settings_are_refused_in_one_line(tmp_path, capsys):
    assert train_main(["--rollout-rs", "token", "--rollout-rs-lower", "3", "--rollout-rs-upper", "2",
                       "--output-dir", str(tmp_path / "a")]) == 2
    assert "--rollout-rs-lower 3.0: must not exceed --rollout-rs-upper (2.0)" in capsys.readouterr().err
    assert train_main(["--rollout-is", "token", "--no-recompute-old-logprobs", "--output-dir", str(tmp_path / "b")]) == 2
    assert "need --recompute-old-logprobs" in capsys.readouterr().err
    assert train_main(["--rollout-is", "tokens", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--rollout-is" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        checked(TrainConfig.from_flat(rollout_is_threshold=0.0, output_dir=str(tmp_path / "d")))
    assert checked(TrainConfig.from_flat(rollout_is="sequence", output_dir=str(tmp_path / "e"))).update.corrects_rollouts


def test_micro_batches_cut_the_rollout_fields_with_the_responses():
    rows = [random_trajectory(random.Random(seed)) for seed in range(6)]
    batch = collate_rows(rows)
    batch.rollout_is_weights = torch.rand(batch.responses.shape)
    widths = set()
    for part, micro in micro_batches(batch, torch.arange(6), 2):
        width = micro.responses.shape[1]
        widths.add(width)
        assert torch.equal(micro.rollout_logprobs, batch.rollout_logprobs[part, :width])
        assert torch.equal(micro.rollout_is_weights, batch.rollout_is_weights[part, :width])
    assert min(widths) < batch.responses.shape[1]  # some micro-batch was cut


@pytest.mark.slow
def test_every_batch_the_trainer_builds_keeps_response_mask_equal_to_the_assistant_spans(tiny_mid, tmp_path, monkeypatch):
    """Issue 37 item 6: score used to overwrite response_mask with the rollout-rs loss mask. Over a training run
    with rejection on, every batch reaching the update keeps the contract, and its loss_mask is a subset of it."""
    seen = []
    update = PPO.update

    def checked_update(self, batch, step):
        assistant = (batch.spans == ASSISTANT).to(batch.response_mask.dtype)
        seen.append((torch.equal(batch.response_mask, assistant),
                     bool((batch.loss_mask <= batch.response_mask).all()), float(batch.loss_mask.sum()),
                     float(batch.response_mask.sum())))
        return update(self, batch, step)

    monkeypatch.setattr(PPO, "update", checked_update)
    trainer = Trainer(small_config(tiny_mid, tmp_path, steps=2, mini_batches=1, rollout_rs="token",
                                   rollout_rs_lower=1.0, rollout_rs_upper=1.0, recompute_old_logprobs=True))
    history = trainer.train()
    assert len(seen) == 2 and all(equal and subset for equal, subset, _, _ in seen), seen
    assert any(kept < whole for _, _, kept, whole in seen)  # ratios not exactly 1 were rejected
    assert all("clip_frac" in m and "clipfrac" not in m and "approx_kl" not in m for m in history)
