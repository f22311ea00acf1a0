"""The tables the rollout command prints: a run's summary and what the estimator gives its batch."""

from __future__ import annotations

from rich.table import Table

from agent_loop.options import plural, rate
from agent_loop.runners.stats import RolloutStats


def episode_set(count: int, first: int | None, last: int | None) -> str:
    """The true label of ``count`` distinct episode indices from ``first`` to ``last``: ``episodes 0-47`` only when
    they are every index of that range, else ``28 of episodes 20-47`` (after a --resume, the ones it lacked)."""
    if first is None or last is None:
        return plural(count, "episode")
    span = f"episode {first}" if first == last else f"episodes {first}-{last}"
    return span if count == last - first + 1 else f"{count} of {span}"


def summary_table(stats: RolloutStats, title: str) -> Table:
    """Success, reward, turns, token counts, finish reasons and tool errors of a run (its RolloutStats); the
    title says which episodes they are (:func:`episode_set`)."""
    table = Table(title=f"{title}: {episode_set(stats.episodes, stats.first_index, stats.last_index)}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("episodes", f"{stats.episodes}" + (f" ({plural(stats.segments, 'segment')})"
                                            if stats.segments != stats.episodes else "")),
        (f"success rate ({stats.sampling}, {plural(stats.episodes, 'episode')})", rate(stats.success_rate)),
        ("mean reward", f"{stats.mean('reward_sum'):.3f}"),
        ("mean turns", f"{stats.mean('turns'):.2f}"),
        ("assistant tokens / episode", f"{stats.mean('assistant_tokens'):.1f}"),
        ("observation tokens / episode", f"{stats.mean('observation_tokens'):.1f}"),
        ("tool calls / episode", f"{stats.mean('tool_calls'):.2f}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in stats.finish_reasons.most_common())),
        ("tool errors", ", ".join(f"{k} {v}" for k, v in stats.tool_errors.most_common()) or "none"),
        ("reward errors (episodes ended as errors)", f"{stats.reward_errors}"),
        ("template mismatch / drift episodes", f"{stats.template_mismatches} / {stats.template_drifts}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def failure_summary(stats: RolloutStats) -> str | None:
    """Why a run has nothing to summarize (every episode errored, or too few assistant tokens to whiten), from
    the episodes' own records; None when there is something to summarize."""
    # torch: the rollout path imports this module without it
    from advantages import whitenable

    errors = stats.finish_reasons.get("error", 0)
    if stats.episodes and errors == stats.episodes:
        first = "; ".join(f"episode {i}: {message}" for i, message in stats.first_errors)
        scoring = f", {stats.reward_errors} of them in scoring (the reward failed or hung)" if stats.reward_errors else ""
        return f"every episode ({errors}) ended in an error{scoring}; first: {first}"
    if not whitenable(stats.assistant_tokens):
        return (f"the {plural(stats.episodes, 'episode')} sampled "
                f"{plural(stats.assistant_tokens, 'assistant token')} in all "
                f"(finish reasons: {dict(stats.finish_reasons)}); nothing to compute returns on")
    return None


def returns_table(trajectories, pad_token_id: int, options) -> Table:
    """Collate the batch and show what the registered estimator of ``options`` (``EstimatorOptions``: the estimator
    and its settings, given as its settings instance) gives the assistant tokens: it gets the batch fields it
    accepts (``agent_loop.runners.batch.estimator_arguments``), ``index`` the question each episode played
    (``info["group"]`` with ``--group-size`` 2 or more; else each episode is a group of its own)."""
    # torch: the rollout path imports this module without it
    import torch

    from advantages import get_estimator  # torch, as above
    from agent_loop.runners.batch import estimator_arguments, trajectories_to_batch  # torch, as above

    batch = trajectories_to_batch(trajectories, pad_token_id=pad_token_id)
    batch.index = torch.tensor([t.info.get("group", t.info["index"]) for t in trajectories], dtype=torch.long)
    entry, settings = get_estimator(options.estimator), options.estimator_settings()
    adv, returns = entry(batch.token_level_rewards, batch.response_mask, settings=settings,
                         **estimator_arguments(entry, batch))
    indices = sorted({t.info["index"] for t in trajectories})
    discount = f" (gamma={settings.gamma})" if settings is not None else ""
    table = Table(title=f"batch tensors and {options.estimator}{discount}, "
                        f"{episode_set(len(indices), indices[0], indices[-1])}")
    mask = batch.response_mask.bool()
    table.add_column("tensor")
    table.add_column("value", justify="right")
    table.add_row("responses shape (b, t)", str(tuple(batch.responses.shape)))
    table.add_row("ASSISTANT / OBSERVATION / PAD tokens",
                  " / ".join(str(int((batch.spans == k).sum())) for k in (1, 2, 0)))
    table.add_row("mean return on ASSISTANT tokens", f"{returns[mask].mean():.4f}")
    table.add_row("first-turn ASSISTANT tokens with nonzero return",
                  f"{int(((batch.turn_ids == 0) & mask & (returns != 0)).sum())}")
    table.add_row("advantage mean / std (ASSISTANT)", f"{adv[mask].mean():.3f} / {adv[mask].std():.3f}")
    turns = int(batch.turn_ids.max()) + 1 if batch.turn_ids.numel() else 0
    per_turn = [adv[mask & (batch.turn_ids == k)] for k in range(min(turns, 8))]
    table.add_row(f"mean advantage by turn (turns 0-{max(len(per_turn) - 1, 0)}, ASSISTANT)",
                  " / ".join(f"{a.mean():.3f}" if a.numel() else "-" for a in per_turn))
    table.add_row("max |return| on OBSERVATION/PAD", f"{returns.masked_fill(mask, 0).abs().max():.1f}")
    return table
