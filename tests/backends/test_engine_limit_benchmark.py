"""benchmarks/engine_limit.py (issue 48 item 1, issue 56 item 4) at tiny sizes on the tiny agent: the loop run is
recorded, the engine replays exactly its token work (same prompts, same generated counts), per episode or turn by turn
with barriers (checked on a scripted engine), and the table's columns hold sane values."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_limit():
    spec = importlib.util.spec_from_file_location("engine_limit", ROOT / "benchmarks" / "engine_limit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_limit"] = module
    spec.loader.exec_module(module)
    return module


def test_busy_share_mean_in_flight_and_below_c_against_a_plain_reference(engine_limit):
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    busy, in_flight, below = engine_limit.in_flight_stats(spans, 0.0, 10.0, 2)
    steps = [i / 100 for i in range(1000)]  # the plain reference: count the requests in flight at each 10 ms
    levels = [sum(start <= t < end for start, end in spans) for t in steps]
    assert busy == pytest.approx(sum(level > 0 for level in levels) / len(steps), abs=0.01)  # 4 s of 10
    assert in_flight == pytest.approx(sum(levels) / len(steps), abs=0.01)  # 5 request-seconds over 10 s
    assert below == pytest.approx(sum(level < 2 for level in levels) / len(steps), abs=0.01)  # 2 in flight: 1 s of 10


# scripted episodes: per session, its turns' (generated count, seconds the scripted engine takes for that request)
SCRIPT = {"a": [(3, 0.05), (2, 0.01)], "b": [(4, 0.01), (1, 0.04), (2, 0.01)], "c": [(2, 0.02)],
          "d": [(1, 0.03), (5, 0.02)], "e": [(2, 0.01), (2, 0.01)]}


def recorded(script: dict[str, list[tuple[int, float]]]) -> list[tuple]:
    """Recorder calls (session, prompt, n, start, end, seed) of ``script``'s episodes as the loop would have made
    them: each request 1 s, 0.5 s between an episode's turns, each turn's prompt extending the one before's."""
    calls = []
    for i, (session, turns) in enumerate(script.items()):
        at, prompt = float(i), [i]
        for k, (n, _) in enumerate(turns):
            calls.append((session, list(prompt), n, at, at + 1.0, 100 * i + k))
            prompt += [7] * n + [8]  # the reply, then an observation
            at += 1.5
    return calls


class ScriptedEngine:
    """A replay's ``generate_exact``: sleeps each request's scripted time and logs (prompt, n, seed, session, start,
    end) in event-loop time; answers n tokens (one more for a prompt in ``wrong``); ``most``: the most in flight."""

    def __init__(self, seconds: dict[tuple, float]):
        self.seconds, self.wrong, self.log, self.in_flight, self.most = seconds, set(), [], 0, 0

    async def __call__(self, prompt, n, seed, session):
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.seconds[(session, len(prompt))])
        self.in_flight -= 1
        self.log.append((prompt, n, seed, session, started, loop.time()))
        return n + (tuple(prompt) in self.wrong)


def scripted(engine_limit):
    calls = recorded(SCRIPT)
    episodes = engine_limit.episodes_of(calls)
    seconds = {(call[0], len(call[1])): SCRIPT[call[0]][k][1] for episode in episodes for k, call in enumerate(episode)}
    return calls, episodes, ScriptedEngine(seconds)


def same_requests(log, calls) -> bool:
    """Exactly the recorded requests, each once: the same prompt, count, seed and session."""
    return (sorted((tuple(prompt), n, seed, session) for prompt, n, seed, session, _, _ in log)
            == sorted((tuple(call[1]), call[2], call[5], call[0]) for call in calls))


@pytest.mark.parametrize("concurrency", [2, 8])
def test_turns_replay_plays_exactly_the_recorded_requests_turn_by_turn_with_barriers(engine_limit, concurrency):
    calls, episodes, engine = scripted(engine_limit)
    spans = []
    wall = asyncio.run(engine_limit.replay(episodes, concurrency, engine, "turns", spans))
    assert same_requests(engine.log, calls)
    turn_of = {(tuple(call[1]), call[0]): k for episode in episodes for k, call in enumerate(episode)}
    turns = [turn_of[(tuple(prompt), session)] for prompt, _, _, session, _, _ in engine.log]
    assert sorted(turns) == [0] * 5 + [1] * 4 + [2]
    for k in (1, 2):  # the barrier: no turn k request starts before every turn k-1 request has ended
        ended = max(entry[5] for entry, turn in zip(engine.log, turns) if turn == k - 1)
        started = min(entry[4] for entry, turn in zip(engine.log, turns) if turn == k)
        assert started >= ended
    assert engine.most == min(concurrency, len(episodes))  # the 5 first turns: up to c at once
    assert len(spans) == len(calls) and all(0 <= start <= end <= wall + 1e-6 for start, end in spans)


def test_episodes_replay_keeps_each_episodes_turns_in_order_without_barriers(engine_limit):
    calls, episodes, engine = scripted(engine_limit)
    asyncio.run(engine_limit.replay(episodes, 2, engine, "episodes"))
    assert same_requests(engine.log, calls)
    for episode in episodes:  # in the recorded order, one after the other
        mine = sorted((start, end, tuple(prompt)) for prompt, _, _, session, start, end in engine.log
                      if session == episode[0][0])
        assert [prompt for _, _, prompt in mine] == [tuple(call[1]) for call in episode]
        assert all(after[0] >= before[1] for before, after in zip(mine, mine[1:]))
    assert engine.most == 2
    # no barrier: "b"'s second turn (after its quick first) starts before "a"'s slow first turn has ended
    first_a = next(end for prompt, _, _, session, _, end in engine.log if session == "a" and len(prompt) == 1)
    assert any(start < first_a for prompt, _, _, session, start, _ in engine.log if session == "b" and len(prompt) > 1)


def test_a_replay_that_generates_another_count_raises(engine_limit):
    calls, episodes, engine = scripted(engine_limit)
    engine.wrong = {tuple(calls[1][1])}
    with pytest.raises(RuntimeError, match="asked for exactly"):
        asyncio.run(engine_limit.replay(episodes, 4, engine, "turns"))
    with pytest.raises(ValueError, match="episodes, turns"):
        asyncio.run(engine_limit.replay(episodes, 4, engine, "all"))


def test_gaps_between_turns_and_their_p90(engine_limit):
    calls = recorded(SCRIPT)
    assert engine_limit.turn_gaps(calls) == pytest.approx([0.5] * 5)  # 10 requests of 5 episodes: 5 gaps of 0.5 s
    assert engine_limit.p90([3.0, 1.0, 2.0, 10.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]) == 9.0  # nearest rank
    assert engine_limit.p90([0.2]) == 0.2 and engine_limit.p90([]) is None
    assert engine_limit.reusable_prefix(calls) > 0


def check_rows(rows, backend, concurrency, replays=("episodes",)):
    assert [(r["backend"], r["concurrency"]) for r in rows] == [(backend, c) for c in concurrency]
    for r in rows:
        assert r["tokens"] > 0 and r["turns"] >= r["episodes"]
        assert r["turns_per_episode"] == pytest.approx(r["turns"] / r["episodes"])
        assert r["engine"] > 0 and r["ours"] > 0
        assert list(r["replays"]) == list(replays) and r["engine"] == r["replays"][replays[0]]["tok_s"]
        assert r["ratio"] == pytest.approx(r["ours"] / r["engine"])
        for replay in r["replays"].values():
            assert replay["ratio"] == pytest.approx(r["ours"] / replay["tok_s"])
            assert 0 < replay["ratio"] < 5  # the same work: ours cannot be far faster than the engine alone
            assert 0 < replay["in_flight"] <= 1.0001 and 0 <= replay["below"] <= 1.0001
        assert 0 < r["busy"] <= 1.0001 and 0 < r["in_flight"] <= 1.0001 and 0 <= r["below"] <= 1.0001
        assert r["gaps"] == r["turns"] - r["episodes"]
        if r["gaps"]:
            assert 0 <= r["gap_mean_ms"] and 0 <= r["gap_p90_ms"] and r["tools_ms_per_gap"] >= 0
        assert all(cpu >= 0 for cpu in r["cpu"])


def test_quick_run_on_transformers_prints_the_table(engine_limit, capsys):
    rows = engine_limit.main(["--quick", "--backends", "hf", "--threads", "1", "--replay", "episodes", "turns"])
    check_rows(rows, "transformers", [1, 4], ("episodes", "turns"))
    assert any(r["turns_per_episode"] > 1 for r in rows)  # the tiny agent calls its tool: multi-turn work
    out = capsys.readouterr().out
    assert "| " + " | ".join(engine_limit.columns(("episodes", "turns"))) + " |" in out
    assert "| " + " | ".join(engine_limit.gap_columns(("episodes", "turns"))) + " |" in out
    assert "Main thread's time in the profiled loop run" in out
    for r in rows:
        assert sum(r["profile"].values()) == pytest.approx(1.0)
        assert r["profile"]["rendering"] > 0 and r["profile"]["sink"] > 0


@pytest.mark.slow
def test_quick_run_on_the_vllm_engine_replays_the_exact_token_counts(engine_limit, capsys):
    rows = engine_limit.main(["--quick", "--backends", "vllm", "--threads", "1", "--no-profile",
                              "--replay", "turns", "episodes"])
    check_rows(rows, "vLLM in process", [1, 4], ("turns", "episodes"))  # a replay of another count raises
