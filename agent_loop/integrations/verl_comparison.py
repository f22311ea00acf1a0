"""Compare ``advantages`` with the installed verl, function by function, and the plugin inside verl's own
``compute_advantage``; ``agent-loop verl-check`` (``agent_loop.cli.verl_check``) prints the rows in an
environment with verl (docs/verl.md; the tests run it in the side environments against verl 0.9.1 and 0.8.0).

One row per check: the largest difference over 5 random multi-turn batches (observation spans, trailing
padding, an empty row). Status ``ok`` (within tolerance), ``expected`` (a difference docs/verl.md lists for
this verl version, confirmed: the note says how) or ``FAIL`` (over tolerance, or an exception). Every
section imports what it needs itself, so a missing verl module fails its own rows only. This module returns
the rows (:func:`run_checks`); it prints nothing.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

import advantages as ours
from agent_loop.integrations import verl as plugin

FLOAT_TOLERANCE = 1e-9  # float64 values and masks: what is left is rounding (measured <= 3e-10)
# int64 masks (verl's agent loop emits them): verl's masked_var divides int64 counts (`mask_sum / (mask_sum - 1)`),
# which torch does in float32; measured 4.6e-8 relative (max |ours - verl| / max |verl|), tolerance 2 float32 ulps
INT64_RELATIVE_TOLERANCE = 2.4e-7
FLOAT32_GROUP_STATS_TOLERANCE = 1e-5  # verl's *_vectorized group statistics: float32 sums of squares
METRICS_TOLERANCE = 1e-6  # verl's metrics (Python floats from `.item()`): measured 2.9e-8
GROUPS = (0, 0, 0, 1, 1, 1, 2, 2)  # prompts of the 8 rows (row 3, in group 1, is empty)
GROUPS_WITH_SINGLES = (0, 0, 0, 1, 1, 2, 3, 4)  # groups 2, 3 and 4 hold one row each


class Documented(Exception):
    """A difference docs/verl.md lists for this verl version, confirmed; the message says how, ``diff`` is the
    measured difference (0 where there is no number to give)."""

    def __init__(self, message: str, diff: float = 0.0):
        super().__init__(message)
        self.diff = diff


def verl_version() -> tuple[int, ...]:
    import verl  # verl: optional; a missing module fails its own rows

    return tuple(int(part) for part in verl.__version__.split(".")[:2] if part.isdigit())


def multi_turn_batch(seed: int, mask_dtype=torch.float64, groups=GROUPS):
    """Rewards, values, mask (0 on observations and trailing padding; row 3 empty), uids, log-probs, advantages."""
    generator = torch.Generator().manual_seed(seed)
    b, t = len(groups), 24
    mask = torch.ones(b, t, dtype=torch.float64)
    for row in range(b):
        length = int(torch.randint(t // 2, t + 1, (1,), generator=generator))
        mask[row, length:] = 0
        start = int(torch.randint(1, max(2, length - 4), (1,), generator=generator))
        mask[row, start:start + 3] = 0  # an observation span
    mask[3] = 0
    last = torch.where(mask.bool(), torch.arange(t), -1).amax(-1)
    rewards = torch.zeros(b, t, dtype=torch.float64)
    for row in range(b):
        if last[row] >= 0:
            rewards[row, last[row]] = float(torch.randn((), generator=generator, dtype=torch.float64))
    values = torch.randn(b, t, generator=generator, dtype=torch.float64)
    uids = np.array([f"prompt-{group}" for group in groups], dtype=object)
    log_prob = -torch.rand(b, t, generator=generator, dtype=torch.float64) * 3
    old_log_prob = log_prob + torch.randn(b, t, generator=generator, dtype=torch.float64) * 1.5
    advantages = torch.randn(b, t, generator=generator, dtype=torch.float64)
    return rewards, values, mask.to(mask_dtype), uids, log_prob, old_log_prob, advantages


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64).detach()  # verl's metrics are Python floats: no float32 detour


def max_diff(*pairs) -> float:
    return max(float((_f64(a) - _f64(b)).abs().max()) for a, b in pairs)


def relative_diff(*pairs) -> float:
    """``max |ours - verl| / max |verl|`` over the pairs (0 when both are 0)."""
    scale = max(float(_f64(b).abs().max()) for _, b in pairs)
    return max_diff(*pairs) / scale if scale else max_diff(*pairs)


def _pairs(mine, theirs, diff=max_diff) -> float:
    return diff(*zip(mine, theirs))


def reinforce_plus_plus_check(verl, rewards, mask, gamma, tolerance, diff=max_diff):
    """verl's REINFORCE++ against ours; verl before 0.9 (PR #7300) must equal our reset-at-observation ablation."""
    theirs = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=SimpleNamespace(gamma=gamma))
    gap = _pairs(ours.reinforce_plus_plus(rewards, mask, gamma), theirs, diff)
    if gap > tolerance and verl_version() < (0, 9):
        reset = _pairs(ours.reinforce_plus_plus_reset_at_observation(rewards, mask, gamma), theirs, diff)
        if reset <= tolerance:
            raise Documented(f"verl < 0.9 resets at observations (before PR #7300): equals our "
                             f"reinforce_plus_plus_reset_at_observation to {reset:.1e}", gap)
    return gap


def estimator_checks(seed: int, mask_dtype=torch.float64, groups=GROUPS, tolerance=FLOAT_TOLERANCE, diff=max_diff):
    """``(name, tolerance, check)`` for the advantage estimators against verl's ``core_algos.compute_*_advantage``."""
    from verl.trainer.ppo import core_algos as verl  # verl: optional; a missing module fails its own rows

    rewards, values, mask, uids, *_ = multi_turn_batch(seed, mask_dtype, groups)
    for gamma in (1.0, 0.9):
        yield f"reinforce_plus_plus gamma={gamma}", tolerance, lambda gamma=gamma: reinforce_plus_plus_check(
            verl, rewards, mask, gamma, tolerance, diff)
    yield "gae (on the mask: verl leaves values off it)", tolerance, lambda: _pairs(
        ours.gae(rewards, values, mask, 0.95, 0.9),
        [x * mask for x in verl.compute_gae_advantage_return(rewards, values, mask, 0.95, 0.9)], diff)
    for norm in (True, False):
        yield f"grpo norm_by_std={norm}", tolerance, lambda norm=norm: _pairs(
            ours.grpo(rewards, mask, uids, 1e-6, norm), verl.compute_grpo_outcome_advantage(rewards, mask, uids, 1e-6, norm),
            diff)
    yield "rloo", tolerance, lambda: _pairs(ours.rloo(rewards, mask, uids), verl.compute_rloo_outcome_advantage(
        rewards, mask, uids), diff)
    yield "reinforce_plus_plus_baseline", tolerance, lambda: _pairs(
        ours.reinforce_plus_plus_baseline(rewards, mask, uids),
        verl.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids), diff)


def int64_estimator_checks(seed: int):
    """The estimators with int64 masks (as verl's agent loop emits) and groups of one row."""
    yield from estimator_checks(seed, torch.int64, GROUPS_WITH_SINGLES, INT64_RELATIVE_TOLERANCE, relative_diff)


def vectorized_checks(seed: int):
    """verl's ``grpo_vectorized`` / ``rloo_vectorized`` against our ``grpo`` / ``rloo``, with groups of one."""
    from verl.trainer.ppo import core_algos as verl  # verl: optional; a missing module fails its own rows

    rewards, _, mask, uids, *_ = multi_turn_batch(seed, torch.int64, GROUPS_WITH_SINGLES)
    single = torch.tensor([list(GROUPS_WITH_SINGLES).count(g) == 1 for g in GROUPS_WITH_SINGLES])

    def rloo_vectorized():
        theirs = verl.compute_rloo_vectorized_outcome_advantage(rewards, mask, uids)[0]
        mine = ours.rloo(rewards, mask, uids)[0]
        rest = max_diff((mine[~single], theirs[~single]))
        kept = bool(mine[single].abs().amax() > 0)
        if rest <= FLOAT_TOLERANCE and kept and float(theirs[single].abs().amax()) == 0.0:
            raise Documented(f"a group of one gets 0 from verl's rloo_vectorized, its score from rloo and ours; "
                             f"other groups agree to {rest:.1e}", max_diff((mine, theirs)))
        return max_diff((mine, theirs))

    def grpo_vectorized():
        gap = relative_diff((ours.grpo(rewards, mask, uids)[0],
                             verl.compute_grpo_vectorized_outcome_advantage(rewards, mask, uids)[0]))
        if FLOAT_TOLERANCE < gap <= FLOAT32_GROUP_STATS_TOLERANCE:
            raise Documented("verl's group_mean_std computes in float32 (sums of squares); relative difference", gap)
        return gap

    yield "grpo_vectorized vs our grpo (relative)", FLOAT_TOLERANCE, grpo_vectorized
    yield "rloo_vectorized vs our rloo", FLOAT_TOLERANCE, rloo_vectorized


def agg_loss_check(verl, loss, mask, mode, *global_batch):
    mine = ours.aggregate_loss(loss, mask, mode, *global_batch)
    try:
        theirs = verl.agg_loss(loss, mask, mode, *global_batch)
    except Exception as error:
        if mode == "token-sum" and verl_version() < (0, 9) and mode in str(error):
            raise Documented(f"verl < 0.9 has no token-sum mode ({type(error).__name__}: {error})") from error
        raise
    return max_diff((mine, theirs))


def loss_checks(seed: int):
    """Loss aggregation and the policy losses against verl's ``agg_loss`` and ``compute_policy_loss_*``."""
    from verl.trainer.ppo import core_algos as verl  # verl: optional; a missing module fails its own rows
    from verl.workers.config import FSDPActorConfig  # verl: optional; a missing module fails its own rows

    _, _, mask, _, log_prob, old_log_prob, adv = multi_turn_batch(seed)
    for mode in ours.LOSS_AGG_MODES:
        yield f"agg_loss {mode}", FLOAT_TOLERANCE, lambda mode=mode: agg_loss_check(verl, adv, mask, mode)
        yield f"agg_loss {mode} dp=2 global", FLOAT_TOLERANCE, lambda mode=mode: agg_loss_check(
            verl, adv, mask, mode, 2, 150, 10, 7)
    config = FSDPActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28,
                             clip_ratio_c=3.0, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1)
    batch = (old_log_prob, log_prob, adv, mask)
    for name in ("vanilla", "gspo", "cispo", "gpg"):
        for mode in ("token-mean", "seq-mean-token-mean"):
            yield f"policy loss {name} {mode}", FLOAT_TOLERANCE, lambda name=name, mode=mode: policy_loss_check(
                verl, config, batch, name, mode)

    def reinforce():
        loss, metrics = ours.reinforce_policy_loss(*batch)
        verl_loss, verl_metrics = verl.compute_policy_loss_reinforce(*batch, config=config)
        return max_diff((loss, verl_loss), (metrics["approx_kl"], verl_metrics["actor/ppo_kl"]))

    yield "policy loss reinforce", FLOAT_TOLERANCE, reinforce


def policy_loss_check(verl, config, batch, name, mode):
    """``(loss diff, metrics diff)``; verl < 0.9's GSPO ignores ``loss_agg_mode`` (seq-mean-token-mean always)."""
    settings = {} if name == "gpg" else dict(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28)
    loss, metrics = ours.get_policy_loss_fn(name)(*batch, mode, **settings)
    verl_loss, verl_metrics = getattr(verl, f"compute_policy_loss_{name}")(*batch, mode, config)
    keys = {"clipfrac": "actor/pg_clipfrac", "clipfrac_lower": "actor/pg_clipfrac_lower", "approx_kl": "actor/ppo_kl"}
    metric_pairs = [(metrics[k], verl_metrics[v]) for k, v in keys.items() if k in metrics]
    gap = max_diff((loss, verl_loss))
    if name == "gspo" and mode != "seq-mean-token-mean" and gap > FLOAT_TOLERANCE and verl_version() < (0, 9):
        as_seq_mean = max_diff((ours.gspo_policy_loss(*batch, "seq-mean-token-mean", **settings)[0], verl_loss))
        if as_seq_mean <= FLOAT_TOLERANCE:
            raise Documented(f"verl < 0.9's GSPO ignores loss_agg_mode: equals ours with seq-mean-token-mean to "
                             f"{as_seq_mean:.1e}", gap)
    return gap, max_diff(*metric_pairs) if metric_pairs else 0.0


def penalty_checks(seed: int):
    """The KL penalties (value and gradient), the value loss and the entropy loss against verl's."""
    from verl.trainer.ppo import core_algos as verl  # verl: optional; a missing module fails its own rows

    rewards, values, mask, _, log_prob, old_log_prob, adv = multi_turn_batch(seed)

    def kl(mode):
        mine, theirs = log_prob.clone().requires_grad_(True), log_prob.clone().requires_grad_(True)
        value, verl_value = ours.kl_penalty(mine, old_log_prob, mode), verl.kl_penalty(theirs, old_log_prob, mode)
        value.sum().backward()
        verl_value.sum().backward()
        return max_diff((value, verl_value), (mine.grad, theirs.grad))

    for mode in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k3+", "low_var_kl+", "k2+"):
        yield f"kl_penalty {mode} (value, gradient)", FLOAT_TOLERANCE, lambda mode=mode: kl(mode)
    vpreds = values + 0.3 * adv
    yield "value loss (loss, clipfrac)", FLOAT_TOLERANCE, lambda: _pairs(
        ours.clipped_value_loss(vpreds, rewards, values, mask, 0.2), verl.compute_value_loss(vpreds, rewards, values,
                                                                                              mask, 0.2))
    logits = torch.randn(3, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    yield "entropy loss", FLOAT_TOLERANCE, lambda: max_diff(
        (ours.entropy_loss(logits, mask[:3, :5]), verl.compute_entropy_loss(logits, mask[:3, :5])))


def plugin_checks(seed: int):
    """The plugin inside verl's own ``ray_trainer.compute_advantage``, with int64 masks as verl's agent loop emits."""
    from verl import DataProto  # verl: optional; a missing module fails its own rows
    from verl.trainer.config import AlgoConfig  # verl: optional; a missing module fails its own rows
    from verl.trainer.ppo import core_algos  # verl: optional; a missing module fails its own rows
    from verl.trainer.ppo.ray_trainer import compute_advantage  # verl: optional; a missing module fails its own rows

    rewards, values, mask, uids, *_ = multi_turn_batch(seed, torch.int64, GROUPS_WITH_SINGLES)

    def run(estimator):
        data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask},
                                   non_tensors={"uid": uids})
        config = AlgoConfig(gamma=0.9, lam=0.95, adv_estimator=estimator)
        out = compute_advantage(data, estimator, gamma=0.9, lam=0.95, config=config)
        return out.batch["advantages"] * mask, out.batch["returns"] * mask

    def registered():
        assert plugin.register() == [plugin.REINFORCE_PLUS_PLUS, plugin.GAE, *plugin.TURN_LEVEL_FOR_VERL]
        assert core_algos.get_adv_estimator_fn(plugin.REINFORCE_PLUS_PLUS) is plugin.reinforce_plus_plus_for_verl
        return max_diff(*zip(run(plugin.REINFORCE_PLUS_PLUS), ours.reinforce_plus_plus(rewards, mask, 0.9)))

    def routed():
        verl_gae = core_algos.compute_gae_advantage_return
        builtin = run("gae")
        try:
            plugin.register(replace_builtin_gae=True)
            assert core_algos.compute_gae_advantage_return is plugin.compute_gae_advantage_return
            return relative_diff(*zip(run("gae"), builtin))
        finally:
            core_algos.compute_gae_advantage_return = verl_gae

    yield "compute_advantage agent_loop_reinforce_plus_plus vs ours", FLOAT_TOLERANCE, registered
    yield "compute_advantage gae routed to ours vs verl's gae", INT64_RELATIVE_TOLERANCE, routed


SECTIONS = {
    "estimators (float64 masks)": estimator_checks,
    "estimators (int64 masks, groups of one; relative)": int64_estimator_checks,
    "vectorized estimators (groups of one)": vectorized_checks,
    "losses": loss_checks,
    "penalties": penalty_checks,
    "plugin in verl's compute_advantage (int64 masks)": plugin_checks,
}


@dataclass
class Row:
    section: str
    name: str
    tolerance: float
    worst: float = 0.0
    status: str = "ok"  # ok, expected (documented for this verl version) or FAIL
    note: str = ""

    def record(self, outcome) -> None:
        """One seed's outcome: a difference, a ``Documented`` difference or an exception."""
        if isinstance(outcome, Documented):
            self.status, self.note = ("FAIL" if self.status == "FAIL" else "expected"), self.note or str(outcome)
            self.worst = max(self.worst, outcome.diff)
        elif isinstance(outcome, BaseException):
            self.status, self.note = "FAIL", f"{type(outcome).__name__}: {outcome}"
        else:
            self.worst = max(self.worst, outcome)
            if outcome > self.tolerance:
                self.status, self.note = "FAIL", f"over the tolerance {self.tolerance:.1e}"


def run_checks(seeds=range(5)) -> list[Row]:
    """Every check of every section on every seed; an exception anywhere is its row's (or section's) FAIL."""
    rows: dict[tuple[str, str], Row] = {}
    for section, make_checks in SECTIONS.items():
        for seed in seeds:
            try:
                checks = list(make_checks(seed))
            except Exception as error:  # the section's imports or set-up: its own row, the other sections run
                rows.setdefault((section, "(section set-up)"), Row(section, "(section set-up)", 0.0)).record(error)
                break
            for name, tolerance, check in checks:
                try:
                    outcome = check()
                except Exception as error:  # Documented included: Row.record tells them apart
                    outcome = error
                row = rows.setdefault((section, name), Row(section, name, tolerance))
                if isinstance(outcome, tuple):  # (loss, metrics): the metrics have their own tolerance
                    rows.setdefault((section, name + " metrics"), Row(section, name + " metrics", METRICS_TOLERANCE)
                                    ).record(outcome[1])
                    outcome = outcome[0]
                row.record(outcome)
    return list(rows.values())
