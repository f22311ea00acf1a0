"""Speed of span-native GiGPO (advantages.gigpo, issue 47 item 3) against two baselines, in one run.

The batch: ``--episodes`` episodes (groups of ``--group-size``) x ``--turns`` turns in rows of
``--tokens`` tokens (1,024 x 8 x 4,096 by default): each turn 100-230 ASSISTANT tokens, before each
later turn an observation of 100-250 tokens drawn from a pool of 12 per group (so anchor states
recur within and across turns), a per-turn reward on each turn's last token plus a 0/1 outcome,
trailing PAD. The same episodes are timed in each layout:

* ours: ``gigpo(..., spans, turn_ids, responses)``, one row per episode; "hot" is
  ``validate=False``, "default" ``validate=True`` (the batch checks, the turn-id check and the
  token-by-token hash collision check);
* verl-agent style: a re-implementation of verl-agent's GiGPO functions (``gigpo/core_gigpo.py``:
  per-trajectory discounted step returns, episode-level normalisation, anchor-state grouping,
  step-level normalisation) with its data layout and grouping semantics: one batch row per step
  (``episodes x turns`` rows, each holding that step's response), uuid strings for the group
  (``index``) and trajectory (``traj_index``) ids, the anchor observation of each step as an array
  of token ids, Python/NumPy loops over rows, groups and clusters (including its per-row
  ``np.where`` over all trajectory ids, O(N^2));
* serial: a plain loop over our rows and their turns (torch slices per turn, dicts for the groups)
  computing exactly what ``gigpo`` computes (max |diff| printed).

verl-agent's own step baseline includes the step itself (so its values differ from ours; see
docs/design.md "Turn-level credit"); its time is what matters here. Times are process CPU time
(robust on a shared machine; ``--wall`` for wall time) with ``--threads`` torch threads; ours are
medians of ``--repeats`` calls after a warm-up, the baselines' of ``--baseline-repeats``.

``--device cuda`` times our hot path on the GPU (CUDA events, synchronised only around the
timed calls) under ``torch.cuda.set_sync_debug_mode("error")``: a host sync inside ``gigpo``
raises. Usage::

    .venv/bin/python benchmarks/turn_credit.py                    # 1,024 x 8 x 4,096 on the CPU
    .venv/bin/python benchmarks/turn_credit.py --episodes 128     # a quick run
    python benchmarks/turn_credit.py --device cuda                # GPU hot path, no host sync allowed
"""

import argparse
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout (the GPU machine) has no install
from advantages import gigpo  # noqa: E402
from masking.spans import SpanKind  # noqa: E402

# ----------------------------------------------------------------------------- the episodes


def make_episodes(episodes: int, group_size: int, turns: int, tokens: int, seed: int = 0):
    """Per episode: its group, per turn (observation ids before it, assistant ids, reward), outcome."""
    rng = np.random.default_rng(seed)
    groups = episodes // group_size
    pools = [[rng.integers(0, 32000, rng.integers(100, 251)) for _ in range(12)] for _ in range(groups)]
    prompts = [rng.integers(0, 32000, 64) for _ in range(groups)]
    out = []
    for e in range(episodes):
        g = e // group_size
        steps = []
        for k in range(turns):
            obs = np.zeros(0, dtype=np.int64) if k == 0 else pools[g][rng.integers(0, 12)]
            steps.append((obs, rng.integers(0, 32000, rng.integers(100, 231)), float(rng.integers(0, 3)) / 10))
        out.append({"group": g, "steps": steps, "outcome": float(rng.integers(0, 2)), "prompt": prompts[g]})
        assert sum(len(o) + len(a) for o, a, _ in steps) <= tokens
    return out


def span_batch(episodes, tokens: int):
    """Our layout: one row per episode, (b, t) spans, turn_ids, responses, rewards, mask; index (b,)."""
    b = len(episodes)
    spans = torch.zeros(b, tokens, dtype=torch.int8)
    turn_ids = torch.full((b, tokens), -1, dtype=torch.int16)
    responses = torch.zeros(b, tokens, dtype=torch.long)
    rewards = torch.zeros(b, tokens, dtype=torch.float32)
    for row, e in enumerate(episodes):
        p = 0
        for k, (obs, asst, r) in enumerate(e["steps"]):
            spans[row, p : p + len(obs)] = SpanKind.OBSERVATION
            turn_ids[row, p : p + len(obs)] = k - 1
            responses[row, p : p + len(obs)] = torch.from_numpy(obs)
            p += len(obs)
            spans[row, p : p + len(asst)] = SpanKind.ASSISTANT
            turn_ids[row, p : p + len(asst)] = k
            responses[row, p : p + len(asst)] = torch.from_numpy(asst)
            p += len(asst)
            rewards[row, p - 1] = r
        rewards[row, p - 1] += e["outcome"]
    index = torch.tensor([e["group"] for e in episodes])
    return {"token_level_rewards": rewards, "response_mask": (spans == SpanKind.ASSISTANT).float(), "spans": spans,
            "turn_ids": turn_ids, "responses": responses, "index": index}


def step_batch(episodes, width: int):
    """verl-agent's layout: one row per step (``width`` response tokens: the episode's token budget per
    turn); uuid group and trajectory ids; the anchor observation of each step."""
    rows = sum(len(e["steps"]) for e in episodes)
    token_level_rewards = torch.zeros(rows, width)
    response_mask = torch.zeros(rows, width)
    group_uid = {g: str(uuid.uuid4()) for g in {e["group"] for e in episodes}}
    index, traj_index, anchor_obs, step_rewards = [], [], [], []
    row = 0
    for e in episodes:
        traj = str(uuid.uuid4())
        episode_reward = sum(r for _, _, r in e["steps"]) + e["outcome"]
        for k, (obs, asst, r) in enumerate(e["steps"]):
            response_mask[row, : len(asst)] = 1
            token_level_rewards[row, len(asst) - 1] = episode_reward  # every step row carries the episode's reward
            index.append(group_uid[e["group"]])
            traj_index.append(traj)
            anchor_obs.append(e["prompt"] if k == 0 else obs)
            step_rewards.append(r + (e["outcome"] if k == len(e["steps"]) - 1 else 0.0))
            row += 1
    anchor = np.empty(rows, dtype=object)
    anchor[:] = anchor_obs
    return {"token_level_rewards": token_level_rewards, "response_mask": response_mask,
            "index": np.array(index, dtype=object), "traj_index": np.array(traj_index, dtype=object),
            "anchor_obs": anchor, "rewards": np.array(step_rewards, dtype=np.float32)}


# ----------------------------------------------------------------------------- verl-agent style


def _hashable(x):
    """An anchor observation as a dict key (arrays -> tuples), as verl-agent keys its clusters."""
    if isinstance(x, np.ndarray):
        return tuple(x.flatten())  # numpy scalars, as verl-agent's to_hashable
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    return x


def va_step_returns(rewards, traj_index, gamma):
    """Discounted return of each step within its trajectory, recombined by a per-row search."""
    per_traj = {}
    for uid in np.unique(traj_index):
        rows = np.where(traj_index == uid)[0]
        running, out = 0.0, np.zeros(len(rows), dtype=np.float32)
        for j in reversed(range(len(rows))):
            running = rewards[rows[j]] + gamma * running
            out[j] = running
        per_traj[uid] = out
    returns = np.zeros_like(rewards)
    for i, uid in enumerate(traj_index):
        rows = np.where(traj_index == uid)[0]
        returns[i] = per_traj[uid][np.where(rows == i)[0][0]]
    return torch.tensor(returns)


def va_episode_advantage(token_level_rewards, response_mask, index, remove_std, epsilon=1e-6):
    """Episode level: every step row's score (the episode's reward) minus its group's mean over the
    group's step rows (divided by their std without ``remove_std``)."""
    scores = token_level_rewards.sum(-1)
    members = defaultdict(list)
    for i in range(scores.shape[0]):
        members[index[i]].append(scores[i])
    stats = {}
    for uid, values in members.items():
        if len(values) == 1:
            stats[uid] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            stacked = torch.tensor(values)
            stats[uid] = (stacked.mean(), stacked.std())
    for i in range(scores.shape[0]):
        mean, std = stats[index[i]]
        scores[i] = scores[i] - mean if remove_std else (scores[i] - mean) / (std + epsilon)
    return scores.unsqueeze(-1).tile([1, response_mask.shape[-1]]) * response_mask


def va_anchor_groups(anchor_obs, index):
    """A uuid per cluster of identical anchor observations within each group."""
    uids = np.empty(len(anchor_obs), dtype=object)
    for group in np.unique(index):
        rows = np.where(index == group)[0]
        clusters = defaultdict(list)
        for row in rows:
            clusters[_hashable(anchor_obs[row])].append(row)
        for members in clusters.values():
            cluster = str(uuid.uuid4())
            for row in members:
                uids[row] = cluster
    return uids


def va_step_advantage(step_returns, response_mask, step_groups, remove_std, epsilon=1e-6):
    """Step level: each step's return minus its anchor cluster's mean (the step included)."""
    scores = step_returns.clone()
    members = defaultdict(list)
    for i in range(scores.shape[0]):
        members[step_groups[i]].append(scores[i])
    stats = {}
    for uid, values in members.items():
        stacked = torch.tensor(values)
        stats[uid] = (stacked.mean(), torch.tensor(1.0) if len(values) == 1 else stacked.std())
    for i in range(scores.shape[0]):
        mean, std = stats[step_groups[i]]
        scores[i] = scores[i] - mean if remove_std else (scores[i] - mean) / (std + epsilon)
    return scores.unsqueeze(-1).tile([1, response_mask.shape[-1]]) * response_mask


def verl_agent_gigpo(batch, w=1.0, gamma=1.0, remove_std=True):
    step_returns = va_step_returns(batch["rewards"], batch["traj_index"], gamma)
    episode = va_episode_advantage(batch["token_level_rewards"].clone(), batch["response_mask"], batch["index"], remove_std)
    groups = va_anchor_groups(batch["anchor_obs"], batch["index"])
    return episode + w * va_step_advantage(step_returns, batch["response_mask"], groups, remove_std)


# ----------------------------------------------------------------------------- a plain serial loop


def serial_gigpo(batch, w=1.0, gamma=1.0):
    """Our gigpo (mean_norm) row by row and turn by turn: torch slices per turn, dicts per group."""
    spans, turn_ids, responses = batch["spans"], batch["turn_ids"].long(), batch["responses"]
    rewards, index = batch["token_level_rewards"].double(), batch["index"].tolist()
    b = spans.shape[0]
    turns = []  # per row: list of (positions, reward, state)
    for row in range(b):
        per_row, count = [], int(turn_ids[row].max()) + 1
        for k in range(count):
            on = (turn_ids[row] == k) & (spans[row] == SpanKind.ASSISTANT)
            before = (turn_ids[row] == k - 1) & (spans[row] == SpanKind.OBSERVATION)
            state = ("prompt",) if k == 0 else tuple(responses[row][before].tolist())
            per_row.append((on, float(rewards[row][on].sum()), state))
        turns.append(per_row)
    G = []
    for per_row in turns:
        running, out = 0.0, [0.0] * len(per_row)
        for k in reversed(range(len(per_row))):
            running = per_row[k][1] + gamma * running
            out[k] = running
        G.append(out)
    scores = [sum(t[1] for t in per_row) for per_row in turns]
    by_group, by_state, by_turn = defaultdict(list), defaultdict(list), defaultdict(list)
    for row in range(b):
        by_group[index[row]].append(scores[row])
        for k, (_, _, state) in enumerate(turns[row]):
            by_state[index[row], state].append((row, G[row][k]))
            by_turn[index[row], k].append((row, G[row][k]))
    out = torch.zeros_like(rewards)
    for row in range(b):
        members = by_group[index[row]]
        episode = scores[row] - (sum(members) / len(members) if len(members) > 1 else 0.0)
        for k, (on, _, state) in enumerate(turns[row]):
            others = [g for r, g in by_state[index[row], state] if r != row]
            if not others:
                others = [g for r, g in by_turn[index[row], k] if r != row]
            baseline = sum(others) / len(others) if others else 0.0
            out[row][on] = episode + w * (G[row][k] - baseline)
    return out


# ----------------------------------------------------------------------------- timing


def timed(fn, repeats, clock):
    times, result = [], None
    for _ in range(repeats):
        start = clock()
        result = fn()
        times.append(clock() - start)
    return statistics.median(times), result


def ours(batch, validate):
    return gigpo(batch["token_level_rewards"], batch["response_mask"], batch["index"], spans=batch["spans"],
                 turn_ids=batch["turn_ids"], responses=batch["responses"], validate=validate)[0]


def cuda_hot(batch, repeats):
    """Our hot path on the GPU, under sync debug mode "error" (a host sync raises); ms per call."""
    gpu = {k: v.cuda() for k, v in batch.items()}
    ours(gpu, False)  # warm-up: Triton compile, the cached power tables
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        start.record()
        for _ in range(repeats):
            result = ours(gpu, False)
        end.record()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, result.cpu()


def warm_allocator() -> None:
    """Free a block just under 32 MiB, so glibc raises its mmap threshold to it (as in a training
    process that has freed big tensors): the 16 MiB outputs then come from the heap, reused, not
    as fresh pages from the kernel each call (benchmarks/returns.py does the same)."""
    del_me = torch.ones(2**23 - 2**12)
    del del_me


def memory_floor(batch):
    """What any implementation must touch: the inputs read once (copied: spans, turn ids, token ids,
    rewards) and the two float32 outputs written once."""
    for name in ("spans", "turn_ids", "responses", "token_level_rewards"):
        batch[name].clone()
    torch.empty_like(batch["token_level_rewards"]).fill_(0.0)
    torch.empty_like(batch["token_level_rewards"]).fill_(0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of process CPU time")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--skip-baselines", action="store_true", help="time ours only (e.g. on the GPU machine)")
    args = parser.parse_args()
    warm_allocator()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    episodes = make_episodes(args.episodes, args.group_size, args.turns, args.tokens)
    batch = span_batch(episodes, args.tokens)
    print(f"{args.episodes} episodes x {args.turns} turns x {args.tokens} tokens, groups of {args.group_size}, "
          f"{args.threads} thread(s), {'wall' if args.wall else 'process CPU'} time")
    rows = []
    if args.device == "cuda":
        ms, gpu_result = cuda_hot(batch, args.repeats)
        cpu_result = ours(batch, False)
        diff = float((gpu_result.double() - cpu_result.double()).abs().max())
        rows.append(("ours, hot (validate=False), CUDA, no host sync", ms / 1000, diff))
    ours(batch, False)  # warm-up (compiled loops, power tables)
    hot, result = timed(lambda: ours(batch, False), args.repeats, clock)
    default, checked = timed(lambda: ours(batch, True), args.repeats, clock)
    floor, _ = timed(lambda: memory_floor(batch), args.repeats, clock)
    if not args.skip_baselines:
        steps = step_batch(episodes, args.tokens // args.turns)
        va, _ = timed(lambda: verl_agent_gigpo(steps), args.baseline_repeats, clock)
        serial, expected = timed(lambda: serial_gigpo(batch), args.baseline_repeats, clock)
        rows += [("ours, hot (validate=False)", hot, float((result.double() - expected).abs().max())),
                 ("ours, default (validate=True)", default, float((checked.double() - expected).abs().max())),
                 ("memory floor: copy the inputs once, write two outputs", floor, float("nan")),
                 ("verl-agent style (per-step rows, loops)", va, float("nan")), ("serial per-turn loop", serial, 0.0)]
        print("\n| implementation | ms | verl-agent style / this | serial loop / this | max \\|diff\\| vs serial |")
        print("|---|---|---|---|---|")
        for name, seconds, d in rows:
            print(f"| {name} | {seconds * 1000:.1f} | {va / seconds:.0f}x | {serial / seconds:.1f}x | "
                  f"{'n/a' if d != d else f'{d:.1e}'} |")
    else:
        rows += [("ours, hot (validate=False)", hot, float("nan")), ("ours, default (validate=True)", default, float("nan"))]
        for name, seconds, d in rows:
            print(f"| {name} | {seconds * 1000:.2f} ms | max |diff| vs CPU {d:.1e} |")


if __name__ == "__main__":
    main()
