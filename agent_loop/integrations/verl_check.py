"""Compare ``advantages`` with the installed verl, function by function, and the plugin inside verl's
own ``compute_advantage``: ``python -m agent_loop.integrations.verl_check`` (needs verl; not part
of the test suite, whose environment cannot hold verl: docs/verl.md).

Prints one row per check: the largest absolute difference over random multi-turn batches
(observation spans, trailing padding, an empty row), and exits 1 if any exceeds its tolerance.
"""

import sys
from types import SimpleNamespace

import numpy as np
import torch

import advantages as ours
from agent_loop.integrations import verl as plugin

TOLERANCE = 1e-9  # float64 everywhere; the remaining differences are rounding


def multi_turn_batch(seed: int, b: int = 8, t: int = 24):
    """Rewards, values, mask (0 on observations and trailing padding; row 3 empty), uids, logprobs."""
    generator = torch.Generator().manual_seed(seed)
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
    uids = np.array([f"prompt-{row // 3}" for row in range(b)], dtype=object)
    log_prob = -torch.rand(b, t, generator=generator, dtype=torch.float64) * 3
    old_log_prob = log_prob + torch.randn(b, t, generator=generator, dtype=torch.float64) * 1.5
    advantages = torch.randn(b, t, generator=generator, dtype=torch.float64)
    return rewards, values, mask, uids, log_prob, old_log_prob, advantages


def checks(seed: int):
    """Yield ``(name, check)``; ``check()`` returns the largest difference (and one for metrics)."""
    from verl.trainer.ppo import core_algos as verl
    from verl.workers.config import FSDPActorConfig

    batch = multi_turn_batch(seed)
    yield from estimator_checks(verl, batch)
    yield from loss_checks(verl, FSDPActorConfig, batch)
    yield from penalty_checks(verl, batch, seed)
    yield from plugin_checks(seed)


def _pairs(mine, theirs) -> float:
    return max_diff(*zip(mine, theirs))


def estimator_checks(verl, batch):
    """The advantage estimators against verl's ``core_algos.compute_*_advantage``."""
    rewards, values, mask, uids, *_ = batch

    def reinforce_plus_plus(gamma):
        theirs = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=SimpleNamespace(gamma=gamma))
        diff = _pairs(ours.reinforce_plus_plus(rewards, mask, gamma), theirs)
        reset = _pairs(ours.reinforce_plus_plus_reset_at_observation(rewards, mask, gamma), theirs)
        if diff > TOLERANCE and reset <= TOLERANCE:
            raise LookupError(f"verl before PR #7300: equals our reinforce_plus_plus_reset_at_observation to {reset:.1e}")
        return diff

    for gamma in (1.0, 0.9):
        yield f"reinforce_plus_plus gamma={gamma}", lambda gamma=gamma: reinforce_plus_plus(gamma)
    yield "gae (on the mask: verl leaves values off it)", lambda: _pairs(
        ours.gae(rewards, values, mask, 0.95, 0.9),
        [x * mask for x in verl.compute_gae_advantage_return(rewards, values, mask, 0.95, 0.9)])
    for norm in (True, False):
        yield f"grpo uids norm_by_std={norm}", lambda norm=norm: _pairs(
            ours.grpo(rewards, mask, uids, 1e-6, norm), verl.compute_grpo_outcome_advantage(rewards, mask, uids, 1e-6, norm))
    yield "rloo uids", lambda: _pairs(ours.rloo(rewards, mask, uids), verl.compute_rloo_outcome_advantage(rewards, mask, uids))
    yield "reinforce_plus_plus_baseline uids", lambda: _pairs(
        ours.reinforce_plus_plus_baseline(rewards, mask, uids),
        verl.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids))


def loss_checks(verl, actor_config, batch):
    """Loss aggregation and the policy losses against verl's ``agg_loss`` and ``compute_policy_loss_*``
    (``actor_config``: verl's ``FSDPActorConfig`` class, for the clip settings its losses read)."""
    _, _, mask, _, log_prob, old_log_prob, adv = batch
    for mode in ours.LOSS_AGG_MODES:
        yield f"agg_loss {mode}", lambda mode=mode: max_diff(
            (ours.aggregate_loss(adv, mask, mode), verl.agg_loss(adv, mask, mode)))
        yield f"agg_loss {mode} dp=2 global", lambda mode=mode: max_diff(
            (ours.aggregate_loss(adv, mask, mode, 2, 150, 10, 7), verl.agg_loss(adv, mask, mode, 2, 150, 10, 7)))
    config = actor_config(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0,
                          ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1)

    def policy(name, verl_name, mode):
        settings = {} if name == "gpg" else dict(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28)
        loss, metrics = ours.get_policy_loss_fn(name)(old_log_prob, log_prob, adv, mask, mode, **settings)
        verl_loss, verl_metrics = getattr(verl, verl_name)(old_log_prob, log_prob, adv, mask, mode, config)
        keys = {"clipfrac": "actor/pg_clipfrac", "clipfrac_lower": "actor/pg_clipfrac_lower", "approx_kl": "actor/ppo_kl"}
        metric_pairs = [(metrics[k], verl_metrics[v]) for k, v in keys.items() if k in metrics]
        return max_diff((loss, verl_loss)), max_diff(*metric_pairs) if metric_pairs else 0.0

    for name in ("vanilla", "gspo", "cispo", "gpg"):
        for mode in ("token-mean", "seq-mean-token-mean"):
            yield f"policy loss {name} {mode}", lambda name=name, mode=mode: policy(
                name, f"compute_policy_loss_{name}", mode)

    def reinforce():
        loss, metrics = ours.reinforce_policy_loss(old_log_prob, log_prob, adv, mask)
        verl_loss, verl_metrics = verl.compute_policy_loss_reinforce(old_log_prob, log_prob, adv, mask, config=config)
        return max_diff((loss, verl_loss), (metrics["approx_kl"], verl_metrics["actor/ppo_kl"]))

    yield "policy loss reinforce", reinforce


def penalty_checks(verl, batch, seed: int):
    """The KL penalties (value and gradient), the value loss and the entropy loss against verl's."""
    rewards, values, mask, _, log_prob, old_log_prob, adv = batch

    def kl(mode):
        mine, theirs = log_prob.clone().requires_grad_(True), log_prob.clone().requires_grad_(True)
        value, verl_value = ours.kl_penalty(mine, old_log_prob, mode), verl.kl_penalty(theirs, old_log_prob, mode)
        value.sum().backward()
        verl_value.sum().backward()
        return max_diff((value, verl_value), (mine.grad, theirs.grad))

    for mode in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k3+", "low_var_kl+", "k2+"):
        yield f"kl_penalty {mode} (value, gradient)", lambda mode=mode: kl(mode)
    vpreds = values + 0.3 * adv
    yield "value loss (loss, clipfrac)", lambda: _pairs(ours.clipped_value_loss(vpreds, rewards, values, mask, 0.2),
                                                        verl.compute_value_loss(vpreds, rewards, values, mask, 0.2))
    logits = torch.randn(3, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    yield "entropy loss", lambda: max_diff(
        (ours.entropy_loss(logits, mask[:3, :5]), verl.compute_entropy_loss(logits, mask[:3, :5])))


def plugin_checks(seed: int):
    """The plugin inside verl's own ``compute_advantage`` (ray_trainer), against verl's estimators."""
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, values, mask, uids, *_ = multi_turn_batch(seed)

    def run(estimator):
        data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask},
                                   non_tensors={"uid": uids})
        config = AlgoConfig(gamma=0.9, lam=0.95, adv_estimator=estimator)
        out = compute_advantage(data, estimator, gamma=0.9, lam=0.95, config=config)
        return out.batch["advantages"] * mask, out.batch["returns"] * mask

    def registered():
        assert plugin.register() == [plugin.REINFORCE_PLUS_PLUS, plugin.GAE]
        assert core_algos.get_adv_estimator_fn(plugin.REINFORCE_PLUS_PLUS) is plugin.reinforce_plus_plus_for_verl
        return max_diff(*zip(run(plugin.REINFORCE_PLUS_PLUS), ours.reinforce_plus_plus(rewards, mask, 0.9)))

    def routed():
        verl_gae = core_algos.compute_gae_advantage_return
        builtin = run("gae")
        try:
            plugin.register(replace_builtin_gae=True)
            return max_diff(*zip(run("gae"), builtin))
        finally:
            core_algos.compute_gae_advantage_return = verl_gae

    yield "plugin: verl compute_advantage agent_loop_reinforce_plus_plus vs ours", registered
    yield "plugin: verl compute_advantage gae routed to ours vs verl's", routed


def max_diff(*pairs) -> float:
    return max(float((torch.as_tensor(a, dtype=torch.float64).detach() - torch.as_tensor(b, dtype=torch.float64)).abs().max())
               for a, b in pairs)


def main() -> int:
    torch.set_num_threads(1)
    import verl

    worst: dict[str, float | str] = {}
    for seed in range(5):
        for name, check in checks(seed):
            try:
                diffs = check()
            except Exception as error:  # an older verl without this mode or function, or its old semantics
                worst[name] = f"{type(error).__name__}: {error}"
                continue
            diffs = diffs if isinstance(diffs, tuple) else (diffs,)
            worst[name] = max(worst.get(name, 0.0), diffs[0])
            if len(diffs) > 1:  # metrics: verl rounds them through float32 .item()
                worst[name + " metrics"] = max(worst.get(name + " metrics", 0.0), diffs[1])
    failed = 0
    print(f"agent-loop advantages vs verl {verl.__version__}: max |ours - verl| over 5 random multi-turn batches")
    for name, diff in worst.items():
        if isinstance(diff, str):
            print(f"n/a  {'':9}  {name}: {diff[:110]}")
            continue
        tolerance = 1e-6 if name.endswith("metrics") else TOLERANCE
        failed += diff > tolerance
        print(f"{'ok  ' if diff <= tolerance else 'FAIL'} {diff:9.2e}  {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
