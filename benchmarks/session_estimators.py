"""Speed of session-aware estimation (issue 54 item 6): every registered estimator with ``session=``/``segment=``
against the same estimator on the same rows without them, in one run.

The batch: ``--sessions`` sessions (groups of ``--group-size``) x ``--segments`` segments, one row of
``--tokens`` columns per segment (1,024 x 4 x 4,096 by default: 4,096 rows, 16.8M token positions). A
segment holds turns of 100-230 ASSISTANT tokens with observations of 100-250 tokens between them, as
many as fit in 90-100% of the row; every later segment opens with a summary of 50-100 OBSERVATION
tokens. Per-turn rewards (0, 0.1 or 0.2) sit on each turn's last token, the session's 0/1 outcome on
the last ASSISTANT token of its last segment; critic values and token ids are random, turn states are
one of 12 per turn. Rows are float32, as the trainer's.

For each estimator: "session-free" is the call without sessions (``session=None``: every row its
own episode, the row-per-segment ablation), "session-aware" the call with ``session``/``segment``
(:func:`advantages.sessions.estimate_by_session`: a fast path of ``advantages.sessions.FAST_PATHS`` where the
estimator has one, else join, estimate, split back); the ratio is aware / free. Both with ``validate=False`` (the hot path) and, with ``--validate``, also with the
checks on. Times are medians of ``--repeats`` calls after a warm-up, process CPU time with
``--threads`` torch threads (``--wall`` for wall time). Usage::

    .venv/bin/python benchmarks/session_estimators.py                  # 1,024 x 4 x 4,096 on the CPU
    .venv/bin/python benchmarks/session_estimators.py --sessions 64    # a quick run
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout has no install
from advantages import ESTIMATORS, get_estimator  # noqa: E402
from masking.spans import SpanKind  # noqa: E402

SETTINGS = {"gamma": 1.0, "lam": 0.95}


def make_batch(sessions: int, segments: int, group_size: int, tokens: int, seed: int = 0) -> dict:
    """The (b, t) tensors of ``sessions x segments`` rows, and ``session``, ``segment``, ``index`` (b,)."""
    rng = np.random.default_rng(seed)
    b = sessions * segments
    spans = np.zeros((b, tokens), dtype=np.int8)
    turn_ids = np.full((b, tokens), -1, dtype=np.int16)
    rewards = np.zeros((b, tokens), dtype=np.float32)
    most_turns = 0
    for row in range(b):
        p, turn, budget = 0, 0, int(tokens * rng.uniform(0.9, 1.0))
        if row % segments:
            header = rng.integers(50, 101)
            spans[row, :header] = SpanKind.OBSERVATION
            p = header
        while True:
            obs = 0 if (turn == 0 and p == 0) else rng.integers(100, 251)
            asst = rng.integers(100, 231)
            if p + obs + asst > budget:
                break
            spans[row, p : p + obs] = SpanKind.OBSERVATION
            turn_ids[row, p : p + obs] = turn - 1
            p += obs
            spans[row, p : p + asst] = SpanKind.ASSISTANT
            turn_ids[row, p : p + asst] = turn
            p += asst
            rewards[row, p - 1] = rng.integers(0, 3) / 10
            turn += 1
        if row % segments == segments - 1:
            rewards[row, p - 1] += float(rng.integers(0, 2))
        most_turns = max(most_turns, turn)
    spans_t = torch.from_numpy(spans)
    states = torch.from_numpy(rng.integers(0, 12, (b, most_turns)))
    turns_per_row = torch.from_numpy(turn_ids).amax(1).long() + 1
    states = torch.where(torch.arange(most_turns) < turns_per_row.unsqueeze(1), states, -1)
    rows = torch.arange(b)
    return {
        "token_level_rewards": torch.from_numpy(rewards), "response_mask": (spans_t == SpanKind.ASSISTANT).float(),
        "spans": spans_t, "turn_ids": torch.from_numpy(turn_ids),
        "responses": torch.from_numpy(rng.integers(0, 32000, (b, tokens))),
        "values": torch.from_numpy(rng.standard_normal((b, tokens), dtype=np.float32)),
        "turn_states": states, "index": rows // segments // group_size,
        "session": rows // segments, "segment": rows % segments,
    }


def timed(fn, repeats: int, clock) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def call(name: str, batch: dict, sessions: bool, validate: bool):
    entry = get_estimator(name)
    fields = {k: batch[k] for k in entry.batch_arguments if k in batch and k not in ("token_level_rewards", "response_mask")}
    fields.pop("validate", None)
    settings = {k: v for k, v in SETTINGS.items() if k in entry.hyperparameters}
    session = {"session": batch["session"], "segment": batch["segment"]} if sessions else {}
    return lambda: entry(batch["token_level_rewards"], batch["response_mask"], **fields, **settings, **session,
                         validate=validate)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1024)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--validate", action="store_true", help="also time with validate=True")
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of process CPU time")
    parser.add_argument("--only", nargs="*", default=None, help="these estimators only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    batch = make_batch(args.sessions, args.segments, args.group_size, args.tokens)
    assistant = int((batch["spans"] == SpanKind.ASSISTANT).sum())
    print(f"{args.sessions} sessions x {args.segments} segments x {args.tokens} tokens ({assistant:,} ASSISTANT), "
          f"groups of {args.group_size}, {args.threads} thread(s), {'wall' if args.wall else 'process CPU'} time, "
          f"median of {args.repeats}")
    print("| estimator | validate | session-free (s) | session-aware (s) | ratio |\n|---|---|---:|---:|---:|")
    for name in args.only or sorted(ESTIMATORS):
        for validate in (False, True) if args.validate else (False,):
            free = timed(call(name, batch, False, validate), args.repeats, clock)
            aware = timed(call(name, batch, True, validate), args.repeats, clock)
            print(f"| `{name}` | {validate} | {free:.3f} | {aware:.3f} | {aware / free:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
