"""``--rollout-dtype`` (issue 57 item 2): episodes sampled in bf16 by a trainer in fp32, the mismatch reported and
corrected with the field's default (token-level truncated importance sampling, threshold 2: verl's rollout_corr)."""

import pytest
import torch

from agent_loop import Trainer
from tests.helpers.trainer_config import small_config


def test_another_precision_turns_the_correction_on_unless_one_is_chosen(tiny_mid, tmp_path, capsys):
    from agent_loop.options import checked

    same = checked(small_config(tiny_mid, tmp_path, rollout_dtype="fp32")).update
    assert same.rollout_is == "off" and not same.corrects_rollouts
    other = checked(small_config(tiny_mid, tmp_path, rollout_dtype="bf16")).update
    assert (other.rollout_is, other.rollout_is_threshold) == ("token", 2.0)
    err = capsys.readouterr().err
    assert "sampled in bf16, trained in fp32" in err and "docs/results/bf16_smollm2.md" in err  # the risk, with the data
    chosen = checked(small_config(tiny_mid, tmp_path, rollout_dtype="bf16", rollout_rs="token")).update
    assert (chosen.rollout_is, chosen.rollout_rs) == ("off", "token")  # the user's choice stands
    both_bf16 = checked(small_config(tiny_mid, tmp_path, rollout_dtype="bf16", dtype="bf16")).update
    assert both_bf16.rollout_is == "off"


@pytest.mark.slow
def test_bf16_rollouts_report_their_mismatch_and_are_corrected(tiny_mid, tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(small_config(tiny_mid, tmp_path / precision, steps=1, rollout_dtype=precision))
        assert trainer.backend.model.dtype == getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[precision])
        runs[precision] = trainer.train_step()
    fp32, bf16 = runs["fp32"], runs["bf16"]
    # the same weights in the same precision: no gap; sampled in bf16: a gap, reported over ASSISTANT tokens
    assert fp32["logprob_mismatch/max_abs"] < 1e-4  # (fp32 batch shapes differ by rounding only)
    assert bf16["logprob_mismatch/max_abs"] > 1e-3 and bf16["mismatch/kl_k3"] > 10 * fp32["mismatch/kl_k3"]
    assert bf16["mismatch/ratio_min"] < 1.0 < bf16["mismatch/ratio_max"]
    assert 0.0 <= bf16["mismatch/frac_capped"] <= 1.0  # the share the truncation (on, by default) capped
