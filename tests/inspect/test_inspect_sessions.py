"""agent-loop inspect on sessions (issue 54 item 4): a session whose agent rewrote its history is several records
(segments); inspect counts it once, chooses it whole and shows its segments in order, with returns that run across
them. The records are built by hand as the proxy writes them (segment 0 ends in ``history_rewrite``; segment 1 is a
fresh render of the rewritten chat), with real token ids from the shared Qwen2.5 tokenizer and its chat template;
the returns are checked against a plain serial reference over the concatenated session."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from rich.console import Console

from agent_loop.cli.inspect import add_arguments, main, selection_of
from agent_loop.episode.chat import ChatFormatter, assistant_message
from agent_loop.inspect import html, plots, runs, steps, terminal
from agent_loop.inspect.load import Problems
from agent_loop.inspect.sessions import sessions_of
from agent_loop.inspect.values import carried, compute_values
from agent_loop.inspect.view import Selection, build_view, scan
from agent_loop.types import Trajectory
from masking.spans import SpanKind

A, O = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION)
GAMMA = 0.9  # < 1: a return then says how far the session's end is, so a segment cut short shows
SYSTEM = {"role": "system", "content": "You are a careful calculator agent."}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def segment(tokenizer, messages: list[dict], turns: list[tuple[str, str | None]], reward: float, index: int,
            number: int, finish: str, turn_rewards: list[float] | None = None) -> Trajectory:
    """One record of session ``s{index}``: the prompt rendered from ``messages``, then per turn the assistant's
    tokens (its text and ``<|im_end|>``) and, where a tool answered, the template's observation tokens."""
    fmt = ChatFormatter(tokenizer, tools=[CALCULATOR])
    messages = list(messages)
    prompt = fmt.prompt_ids(messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    response, spans, turn_ids, logprobs = [], [], [], []
    for turn, (text, result) in enumerate(turns):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        response += ids
        spans += [A] * len(ids)
        turn_ids += [turn] * len(ids)
        logprobs += [-0.5] * len(ids)
        messages.append(assistant_message(text))
        if result is not None:
            tool = [{"role": "tool", "name": "calculator", "content": result}]
            observation = fmt.observation_ids(tool)
            response += observation
            spans += [O] * len(observation)
            turn_ids += [turn] * len(observation)
            logprobs += [0.0] * len(observation)
            messages += tool
    info = {"model_path": tokenizer.name_or_path, "task": "calculator", "seed": 0, "index": index,
            "session_id": f"s{index}", "segment": number}
    return Trajectory(prompt, response, spans, turn_ids, logprobs, messages, [], reward=reward, finish_reason=finish,
                      info=info, turn_rewards=turn_rewards)


def session(tokenizer, index: int, reward: float) -> list[Trajectory]:
    """A two-segment session: the agent calls the calculator twice, then replaces the calls and their results by a
    summary and answers in a fresh context. Segment 0 has a per-turn reward, segment 1 the outcome."""
    question = {"role": "user", "content": "What is 17 * 23 + 4?"}
    first = segment(tokenizer, [SYSTEM, question], [(call("17 * 23"), "391"), (call("391 + 4"), None)], reward,
                    index, 0, "history_rewrite", turn_rewards=[0.25, 0.0])
    summary = {"role": "user", "content": "The calculator says 17 * 23 = 391 and 391 + 4 = 395."}
    second = segment(tokenizer, [SYSTEM, question, summary], [("The answer is 395.", None)], reward, index, 1, "stop")
    return [first, second]


def single(tokenizer, index: int, reward: float) -> Trajectory:
    question = {"role": "user", "content": "What is 2 + 2?"}
    return segment(tokenizer, [SYSTEM, question], [(call("2 + 2"), "4"), ("The answer is 4.", None)], reward, index, 0,
                   "stop")


def serial_session_returns(rows: list[Trajectory], gamma: float) -> list[list[float]]:
    """The reference: one session's segments laid end to end, rewards placed by hand (each turn's reward on its
    last ASSISTANT token, the outcome on the session's last ASSISTANT token), then one backward pass: on an
    ASSISTANT token R = reward + gamma * R, on an OBSERVATION token R is carried unchanged (its return is 0).
    Returns each segment's returns."""
    spans = [s for t in rows for s in t.spans]
    rewards = [0.0] * len(spans)
    at = 0
    for t in rows:
        last = {}
        for p, (s, turn) in enumerate(zip(t.spans, t.turn_ids)):
            if s == A:
                last[turn] = at + p
        for turn, reward in enumerate(t.turn_rewards or []):
            rewards[last[turn]] += reward
        at += len(t.spans)
    rewards[max(p for p, s in enumerate(spans) if s == A)] += rows[-1].reward
    out, running = [0.0] * len(spans), 0.0
    for p in reversed(range(len(spans))):
        if spans[p] == A:
            running = rewards[p] + gamma * running
            out[p] = running
    cuts = [0]
    for t in rows:
        cuts.append(cuts[-1] + len(t.spans))
    return [out[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.fixture(scope="module")
def two_segments(qwen_tokenizer) -> list[Trajectory]:
    return session(qwen_tokenizer, 7, reward=1.0)


@pytest.fixture(scope="module")
def session_file(two_segments, tmp_path_factory):
    path = tmp_path_factory.mktemp("sessions") / "session.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in two_segments))
    return path


@pytest.fixture(scope="module")
def mixed_file(qwen_tokenizer, tmp_path_factory):
    """Episode 5 (a success), session 7 (two segments, a failure, written around episode 6 as a proxy serving
    several sessions at once writes them) and episode 6 (a success)."""
    failed = session(qwen_tokenizer, 7, reward=0.0)
    rows = [single(qwen_tokenizer, 5, 1.0), failed[0], single(qwen_tokenizer, 6, 0.5), failed[1]]
    path = tmp_path_factory.mktemp("sessions") / "mixed.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in rows))
    return path


def assistant_values(values: torch.Tensor, traj: Trajectory) -> list[float]:
    return [float(values[p]) for p, s in enumerate(traj.spans) if s == A]


def on_assistant(reference: list[float], traj: Trajectory) -> list[float]:
    return [reference[p] for p, s in enumerate(traj.spans) if s == A]


def test_carry_through_returns_run_across_the_segments_as_over_the_joined_session(two_segments):
    reference = serial_session_returns(two_segments, GAMMA)
    values = compute_values(two_segments, gamma=GAMMA)
    for row, traj in enumerate(two_segments):
        n = len(traj.spans)
        assert values.compare["carry-through"][row, :n].tolist() == pytest.approx(reference[row], abs=1e-6)
        assert values.returns[row, :n].tolist() == pytest.approx(reference[row], abs=1e-6)
    # the check bites: each segment on its own (row-per-segment) gives segment 0 only its own turn reward
    alone = compute_values([two_segments[0]], gamma=GAMMA).returns[0]
    assert max(abs(a - b) for a, b in zip(assistant_values(alone, two_segments[0]),
                                          on_assistant(reference[0], two_segments[0]))) > 0.1
    # the end of segment 0 continues from segment 1's first assistant token
    first = two_segments[1].spans.index(A)
    assert values.carried_on == [pytest.approx(reference[1][first]), None]


def test_the_summary_counts_the_session_once_with_its_segments_beside(session_file, two_segments, capsys):
    scanned = scan(session_file, Selection("all", 100), gamma=GAMMA)
    assert (scanned.summary.episodes, scanned.summary.segments, scanned.matching) == (1, 2, 1)
    view = build_view(scanned)
    assert view.trajectories == two_segments and view.segments == [2, 2] and view.ids == [7, 7]
    assert main([str(session_file), "--gamma", "0.9", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert f"{session_file}: 1 episode (2 segments)" in out
    assert re.search(r"success rate\s+│\s+1\.000 \(1 of 1\)", out)
    assert re.search(r"mean turns\s+│\s+3\.00", out)  # 2 + 1 turns over one session
    assert "shown" in out and "1 episode" in out.split("shown", 1)[1].split("\n")[0]


def test_an_episode_is_shown_whole_its_segments_in_order(session_file, two_segments, capsys):
    assert main([str(session_file), "--episode", "7", "--values", "--gamma", "0.9", "--width", "200"]) == 0
    out = capsys.readouterr().out
    banner = out.index("episode 7: one session of 2 segments")
    head0, head1 = out.index("episode 7 · segment 0 of 2"), out.index("episode 7 · segment 1 of 2")
    assert banner < head0 < head1
    assert "finish history_rewrite" in out[head0:head1] and "finish stop" in out[head1:]
    reference = serial_session_returns(two_segments, GAMMA)
    first = two_segments[1].spans.index(A)
    continues = out.index(f"returns continue into segment 1: R = {reference[1][first]:.4g}")
    assert head0 < continues < head1
    # the value table of segment 0 shows the session-level returns (the last assistant token of the segment)
    last = max(p for p, s in enumerate(two_segments[0].spans) if s == A)
    row = next(line for line in out[head0:head1].splitlines() if re.match(rf"\s*│\s*{last}\s*│", line))
    assert f"│ {reference[0][last]:+.3f} │" in row


@pytest.mark.parametrize("argv", [["--episode", "7"], ["--worst"], ["--failed", "--all"]])
def test_choosing_an_episode_picks_the_whole_session(mixed_file, argv):
    args = add_arguments(argparse.ArgumentParser()).parse_args([str(mixed_file), *argv])
    scanned = scan(mixed_file, selection_of(args), gamma=GAMMA)
    view = build_view(scanned)
    shown = [view.trajectories[r] for r in view.selected]
    assert [(t.info["index"], t.segment, t.finish_reason) for t in shown] == [
        (7, 0, "history_rewrite"), (7, 1, "stop")]
    assert [view.lines[r] for r in view.selected] == [2, 4]
    assert terminal.shown_line(view, all_mode=False).startswith(("1 episode", "1 of", "all 1"))


def test_the_mixed_file_counts_sessions_and_its_values_join_only_the_session(mixed_file, qwen_tokenizer):
    scanned = scan(mixed_file, Selection("all", 100), gamma=GAMMA)
    s = scanned.summary
    assert (s.episodes, s.segments, s.successes) == (3, 4, 2)
    view = build_view(scanned)
    assert [(view.ids[r], view.trajectories[r].segment) for r in view.selected] == [(5, 0), (7, 0), (7, 1), (6, 0)]
    session_rows = [view.trajectories[1], view.trajectories[2]]
    reference = serial_session_returns(session_rows, GAMMA)  # reward 0: the turn reward of segment 0 only
    for row, ref in zip((1, 2), reference):
        assert view.values.compare["carry-through"][row, :len(ref)].tolist() == pytest.approx(ref, abs=1e-6)
    for row in (0, 3):  # the one-segment episodes, each on its own
        traj = view.trajectories[row]
        alone = serial_session_returns([traj], GAMMA)[0]
        assert view.values.compare["carry-through"][row, :len(alone)].tolist() == pytest.approx(alone, abs=1e-6)
    assert view.values.carried_on == [None, pytest.approx(reference[1][session_rows[1].spans.index(A)]), None, None]


def test_the_html_page_shows_the_session_in_order_with_its_returns(session_file, two_segments):
    page = html.render(build_view(scan(session_file, Selection("all", 100), gamma=GAMMA)))
    assert "file: 1 episode (2 segments)" in page and "this page holds 1 of the 1 episodes" in page
    assert page.index('id="ep-7"') < page.index('id="ep-7-s1"')  # one anchor per segment, in order
    assert page.count("episode 7: one session of 2 segments") == 1
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1)
    rows = json.loads(blob.replace("<\\/", "</"))["rows"]
    reference = serial_session_returns(two_segments, GAMMA)
    for data, ref in zip(rows, reference):
        assert data["ret"] == pytest.approx(ref, rel=1e-3, abs=1e-4)  # 4 significant digits on the page
    assert rows[0]["tail"] == pytest.approx(reference[1][two_segments[1].spans.index(A)], rel=1e-3)
    assert "tail" not in rows[1]


def test_an_observation_run_ending_a_segment_carries_the_next_segments_return():
    spans = [A, A, O, O]
    values = torch.tensor([0.5, 0.6, 0.0, 0.0])
    assert carried(values, spans) == [(2, 4, 0.0)]
    assert carried(values, spans, 0.7) == [(2, 4, 0.7)]


def test_a_session_missing_a_segment_is_named_and_its_record_computed_on_its_own(two_segments, tmp_path, capsys):
    path = tmp_path / "damaged.jsonl"
    path.write_text("{not json\n" + two_segments[1].to_json() + "\n")  # segment 0's line is damaged
    problems = Problems()
    scanned = scan(path, Selection("all", 100), gamma=GAMMA, problems=problems)
    assert any("session s7: segments [1], expected 0..0" in m and "computed each on its own" in m
               for m in problems.lines())
    view = build_view(scanned)
    alone = serial_session_returns([two_segments[1]], GAMMA)[0]
    assert view.values.returns[0, :len(alone)].tolist() == pytest.approx(alone, abs=1e-6)
    assert main([str(path), "--gamma", "0.9"]) == 0
    assert "expected 0..0" in capsys.readouterr().err


def test_a_repeated_session_id_starts_a_new_session(two_segments):
    """A file appended to by two runs may hold the same session id twice: each run's session is its own."""
    grouped = sessions_of([*two_segments, *two_segments])
    assert [[t.segment for t in s.trajectories] for s in grouped] == [[0, 1], [0, 1]]
    assert all(not s.problem for s in grouped)
    values = compute_values([*two_segments, *two_segments], gamma=GAMMA)
    assert torch.equal(values.returns[:2], values.returns[2:])


def test_two_runs_pair_a_session_segment_by_segment_and_count_it_once(session_file):
    c = runs.compare(session_file, session_file)
    assert [(p.a.index, p.a.segment, p.b.segment) for p in c.pairs] == [(7, 0, 0), (7, 1, 1)]
    assert not c.problems and not any(p.differs for p in c.pairs)
    assert runs.stats(c.summaries[0])["episodes"] == "1 (2 segments)"


def test_a_step_file_counts_sessions_and_its_finish_mix_over_segments(mixed_file):
    row = steps.from_step_file(1, mixed_file, Problems())
    assert row.episodes == 3
    assert row.success == pytest.approx(2 / 3) and row.reward == pytest.approx(1.5 / 3)
    assert row.turns == pytest.approx((2 + 2 + 1 + 2) / 3)
    assert row.finish == pytest.approx({"stop": 3 / 4, "history_rewrite": 1 / 4})


def test_the_per_turn_and_compare_tables_and_the_png_name_the_segment(session_file):
    view = build_view(scan(session_file, Selection("all", 100), gamma=GAMMA, compare=True))
    console = Console(width=200, record=True)
    terminal.render(view, console, compare=True, turns_view=True)
    out = console.export_text()
    for k in (0, 1):
        assert f"episode 7 · segment {k} of 2: per turn" in out
        assert f"episode 7 · segment {k} of 2: returns per span run" in out
    titles = [ax.get_title(loc="left") for ax in plots.figure(view).axes]
    assert [t.split(" (line")[0] for t in titles if t.startswith("episode")] == [
        "episode 7 · segment 0 of 2", "episode 7 · segment 1 of 2"]
