"""agent-loop inspect: loading (bad input too), terminal, HTML, PNG and --compare on hand-built
trajectories made of real token ids (the shared Qwen2.5 tokenizer and its real chat template)."""

from __future__ import annotations

import argparse
import html as html_module
import io
import json
import math
import re
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from rich.console import Console

import advantages
import agent_loop.cli.inspect as inspect_cli
from agent_loop.cli.inspect import main
from agent_loop.episode.chat import ChatFormatter, assistant_message
from agent_loop.inspect import html, plots, terminal
from agent_loop.inspect import view as view_module
from agent_loop.inspect.load import Problems, iter_records
from agent_loop.inspect.tokens import segments, turns
from agent_loop.inspect.values import COMPARED, compute_values
from agent_loop.inspect.view import Selection, build_view, scan
from agent_loop.types import ToolCallRecord, Trajectory
from masking.spans import SpanKind

# an observation that tries to run script in the page; it must show as text
HOSTILE = ('<script>document.title="pwned";document.body.appendChild(document.createElement("pwned"))</script>'
           '<img src=x onerror="document.title=\'pwned\'">')

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)


def build_trajectory(tokenizer, question: str, turns: list[tuple[str, list[dict]]], reward: float, **fields) -> Trajectory:
    """A trajectory as the loop records it: prompt rendered by the chat template, assistant tokens
    encoded from the text plus ``<|im_end|>``, observations as the template's delta.

    ``turns``: (assistant text, tool calls as ``{"name", "arguments", "result" | "error_kind"+"error"}``);
    a turn with calls is followed by their tool messages.
    """
    fmt = ChatFormatter(tokenizer, tools=[CALCULATOR])
    messages = [{"role": "system", "content": "You are a careful calculator agent."},
                {"role": "user", "content": question}]
    prompt_ids = fmt.prompt_ids(messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    response, spans, turn_ids, logprobs, records = [], [], [], [], []
    generator = torch.Generator().manual_seed(len(question))
    for turn, (text, calls) in enumerate(turns):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        response += ids
        spans += [SpanKind.ASSISTANT] * len(ids)
        turn_ids += [turn] * len(ids)
        logprobs += (-torch.rand(len(ids), generator=generator) * 3).tolist()
        messages.append(assistant_message(text, [{"name": c["name"], "arguments": c["arguments"]} for c in calls]))
        if not calls:
            continue
        tool_messages = [{"role": "tool", "name": c["name"], "content": c.get("result") or c["error"]} for c in calls]
        observation = fmt.observation_ids(tool_messages)
        response += observation
        spans += [SpanKind.OBSERVATION] * len(observation)
        turn_ids += [turn] * len(observation)
        logprobs += [0.0] * len(observation)
        messages += tool_messages
        records += [ToolCallRecord(c["name"], c["arguments"], turn, c.get("result"), c.get("error_kind"), c.get("error"),
                                   latency_s=0.002) for c in calls]
    info = {"model_path": tokenizer.name_or_path, "task": "calculator", "index": fields.pop("index"), "seed": 0}
    return Trajectory(prompt_ids, response, [int(s) for s in spans], turn_ids, logprobs, messages, records,
                      reward=reward, info=info, **fields)


def call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def batch(tokenizer) -> list[Trajectory]:
    """Three episodes (info.index 10, 11, 12): a success with per-turn rewards, a failure with a tool
    error, and one whose tool result is hostile HTML."""
    calc = {"name": "calculator"}
    return [
        build_trajectory(tokenizer, "What is 17 * 23?", [
            (call("17 * 23"), [{**calc, "arguments": {"expression": "17 * 23"}, "result": "391"}]),
            ("The answer is 391.", []),
        ], reward=1.0, turn_rewards=[0.1, 0.0], index=10),
        build_trajectory(tokenizer, "What is 2 ** 10?", [
            ('<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>',
             [{"name": "calc", "arguments": {"x": 1}, "error_kind": "unknown_tool", "error": "unknown tool 'calc'"}]),
            (call("2 ** 10"), [{**calc, "arguments": {"expression": "2 ** 10"}, "result": "1024"}]),
            ("The answer is 1000.", []),
        ], reward=0.0, finish_reason="max_turns", index=11),
        build_trajectory(tokenizer, "What is 1 + 1?", [
            (call("1 + 1"), [{**calc, "arguments": {"expression": "1 + 1"}, "result": HOSTILE}]),
            ("The answer is 2.", []),
        ], reward=0.5, index=12),
    ]




@pytest.fixture(scope="module")
def rollouts(batch, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "rollouts.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in batch))
    return path


@pytest.fixture(scope="module")
def view(rollouts):
    """Every episode of the file, kept (as --all), values with gamma 0.9."""
    return build_view(scan(rollouts, Selection("all", 100), gamma=0.9, compare=True))


def span_count(trajectories: list[Trajectory], kind: SpanKind) -> int:
    return sum(s == kind for t in trajectories for s in t.spans)


class TokenParser(HTMLParser):
    """Collects every token of a page: the ``<span>`` elements inside a ``<span class="seg a|o">``,
    with their kind (``assistant``/``observation``), the episode row of their section and their text."""

    def __init__(self):
        super().__init__()
        self.tokens: list[dict] = []
        self.stack: list[str] = []  # "seg:a", "seg:o", "tok", "section:<row>" or the tag
        self.row = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "section" and "data-row" in attrs:
            self.row = int(attrs["data-row"])
        if tag == "span" and "seg" in classes:
            self.stack.append("seg:" + ("a" if "a" in classes else "o"))
        elif tag == "span" and self.stack and self.stack[-1].startswith("seg:"):
            kind = "assistant" if self.stack[-1] == "seg:a" else "observation"
            self.tokens.append({"kind": kind, "row": self.row, "text": "", "attrs": attrs})
            self.stack.append("tok")
        elif tag == "span":
            self.stack.append("span")

    def handle_endtag(self, tag):
        if tag == "span" and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "tok":
            self.tokens[-1]["text"] += data


def page_data(page: str) -> dict:
    """The page's JSON block of numbers."""
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1)
    return json.loads(blob.replace("<\\/", "</"))


def parse_tokens(page: str) -> list[dict]:
    parser = TokenParser()
    parser.feed(page)
    return parser.tokens


# -- loading, bad input, streaming -----------------------------------------------------------------

def read_all(path):
    problems = Problems()
    return [(r.line, r.trajectory) for r in iter_records(path, problems)], problems


def test_load_round_trips_the_batch(rollouts, batch):
    records, problems = read_all(rollouts)
    assert len(problems) == 0
    assert [t for _, t in records] == batch
    assert [line for line, _ in records] == [1, 2, 3]


@pytest.mark.slow  # loads the tokenizer once more through main()
def test_bad_lines_are_named_and_good_lines_still_render(rollouts, batch, tmp_path, capsys):
    good = rollouts.read_text().splitlines()
    short_spans = json.loads(good[1])
    short_spans["spans"] = short_spans["spans"][:-1]
    lines = [good[0], '{"prompt_ids": [1]}', "[1, 2]", json.dumps(short_spans), "", good[2],
             good[1][: len(good[1]) // 2]]  # the last line cut off: an interrupted rollout
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines))

    records, problems = read_all(bad)
    assert [line for line, _ in records] == [1, 6]
    assert [t for _, t in records] == [batch[0], batch[2]]
    found = dict(p.split(": ", 1) for p in problems.lines())
    assert sorted(found) == [f"{bad}:{n}" for n in (2, 3, 4, 7)]
    assert "missing keys" in found[f"{bad}:2"]
    assert "expected a JSON object" in found[f"{bad}:3"]
    assert "spans has" in found[f"{bad}:4"]
    assert "truncated last line" in found[f"{bad}:7"]

    out = tmp_path / "bad.html"
    assert main([str(bad), "--quiet", "--html", str(out)]) == 0
    err = capsys.readouterr().err
    for n in (2, 3, 4, 7):
        assert err.count(f"{bad}:{n}:") == 1  # each bad line reported once
    assert {t["row"] for t in parse_tokens(out.read_text())} == {0, 1}


@pytest.mark.parametrize("content, status, message", [
    (None, 2, "cannot read"),
    ("", 1, "nothing to render"),
    ("\n  \n", 1, "nothing to render"),
    ('{"not": "a trajectory"}\n', 1, "not a Trajectory"),
])
def test_nothing_to_render_names_the_file(tmp_path, capsys, content, status, message):
    path = tmp_path / "rollouts.jsonl"
    if content is not None:
        path.write_text(content)
    assert main([str(path)]) == status
    err = capsys.readouterr().err
    assert str(path) in err and message in err


@pytest.mark.parametrize("kind", ["binary", "text", "folder"])
def test_not_a_jsonl_file_is_one_error_line_and_exit_2(tmp_path, capsys, kind):
    """Issue 15: inspect on a 1 MB binary file printed 26,390 error lines."""
    path = tmp_path / "input"
    if kind == "binary":
        path.write_bytes(torch.randint(0, 256, (1 << 20,), generator=torch.Generator().manual_seed(0),
                                       dtype=torch.uint8).numpy().tobytes())
    elif kind == "text":
        path.write_text("".join(f"episode,{i},reward,{i % 2}\n" for i in range(20000)))
    else:
        path.mkdir()
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and "not a JSON Lines file" in lines[0] or (
        kind == "folder" and "folder" in lines[0]), lines


def test_many_bad_lines_in_a_good_file_are_capped(batch, tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text(batch[0].to_json() + "\n" + "not json\n" * 500 + batch[2].to_json() + "\n")
    assert main([str(path), "--quiet", "--html", str(tmp_path / "o.html")]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 21 and warnings[-1] == "warning: ... and 480 more bad lines"
    assert warnings[0] == f"warning: {path}:2: not valid JSON: Expecting value at column 1"


def test_damaged_first_lines_do_not_hide_the_good_ones(batch, tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    good = batch[0].to_json()
    path.write_text("".join(good[: 40 + k] + "\n" for k in range(4)) + good + "\n")
    assert main([str(path), "--quiet", "--html", str(tmp_path / "o.html")]) == 0
    assert capsys.readouterr().err.count("not valid JSON") == 4


def test_outputs_are_checked_before_reading(rollouts, tmp_path, capsys):
    assert main([str(rollouts), "--html", str(tmp_path / "nope" / "a.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(rollouts), "--png", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main([str(rollouts), "--html", str(rollouts)]) == 2
    assert "input file" in capsys.readouterr().err
    assert rollouts.stat().st_size > 0


def big_file(batch, path: Path, copies: int) -> Path:
    """``copies`` episodes: the batch repeated, each with its own info.index."""
    with open(path, "w") as f:
        for i in range(copies):
            record = json.loads(batch[i % len(batch)].to_json())
            record["info"]["index"] = i
            f.write(json.dumps(record) + "\n")
    return path


def peak_scan(path, selection):
    import tracemalloc

    tracemalloc.start()
    try:
        scanned = scan(path, selection)
        return scanned, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_scan_streams_memory_follows_the_episodes_kept(batch, tmp_path, monkeypatch):
    """Four times the file, the same peak memory: it follows the episodes kept, not the file."""
    monkeypatch.setattr(view_module, "CHUNK", 32)
    small, small_peak = peak_scan(big_file(batch, tmp_path / "small.jsonl", 240), Selection("informative", 3))
    path = big_file(batch, tmp_path / "big.jsonl", 960)
    scanned, peak = peak_scan(path, Selection("informative", 3))
    assert scanned.summary.episodes == 960 and len(scanned.shown) == 3
    assert peak < 1.3 * small_peak, (peak, small_peak)
    assert peak < path.stat().st_size / 2  # the whole file is never held
    # the summary counted every episode in that one pass
    assert scanned.summary.successes == sum(t.reward > 0 for t in batch) * 320
    assert scanned.stats.returns.count == sum(s == SpanKind.ASSISTANT for t in batch for s in t.spans) * 320
    # --all keeps what it shows: memory grows with --max-episodes
    _, kept_peak = peak_scan(path, Selection("all", 960))
    assert kept_peak > 2 * peak


def test_summary_counts_every_episode(rollouts, batch):
    scanned = scan(rollouts, Selection("worst", 1))
    s = scanned.summary
    assert (s.episodes, s.successes, s.reward_sum, scanned.matching) == (3, 2, 1.5, 3)
    assert (s.first_index, s.last_index) == (10, 12)
    assert s.assistant_tokens == span_count(batch, SpanKind.ASSISTANT)
    assert s.observation_tokens == span_count(batch, SpanKind.OBSERVATION)
    per_turn = {}
    for t in batch:
        for turn in sorted(set(t.turn_ids)):
            acc = per_turn.setdefault(turn, [0, 0, 0])
            acc[0] += 1
            acc[1] += sum(1 for k, s_ in zip(t.turn_ids, t.spans) if k == turn and s_ == SpanKind.ASSISTANT)
            acc[2] += sum(1 for k, s_ in zip(t.turn_ids, t.spans) if k == turn and s_ == SpanKind.OBSERVATION)
    assert s.per_turn == per_turn
    assert s.tool_errors == {"unknown_tool": 1} and s.finish_reasons == {"stop": 2, "max_turns": 1}


def test_tokenizer_that_cannot_load_falls_back_to_ids(batch, tmp_path):
    traj = Trajectory.from_json(batch[0].to_json())
    traj.info["model_path"] = str(tmp_path / "no-such-model")
    view = build_view([traj])
    assert view.pieces[0] == [f"[{i}]" for i in traj.response_ids]
    assert any(str(tmp_path / "no-such-model") in p for p in view.problems)


# -- selection -------------------------------------------------------------------------------------

def kept_ids(path, selection):
    scanned = scan(path, selection)
    return [scanned.kept[i][1] for i in scanned.shown], [scanned.kept[i][0].line for i in scanned.shown]


def test_selectors(batch, rollouts, capsys):
    assert kept_ids(rollouts, Selection("worst", 1)) == ([11], [2])
    assert kept_ids(rollouts, Selection("worst", 2)) == ([11, 12], [2, 3])
    assert kept_ids(rollouts, Selection("all", 100, failed=True)) == ([11], [2])
    # --episode is info.index, not the line: 12 is on line 3
    assert kept_ids(rollouts, Selection("ids", 2, [12, 10])) == ([10, 12], [1, 3])
    # the default: the failure (with its tool error and unusual finish), then a success
    ids, _ = kept_ids(rollouts, Selection("informative", 3))
    assert ids[0] == 11 and set(ids[1:]) <= {10, 12} and len(ids) == 3
    assert main([str(rollouts), "--episode", "7"]) == 1
    assert "no episode with info.index 7" in capsys.readouterr().err
    assert main([str(rollouts), "--episode", "12", "--width", "100"]) == 0
    assert "episode 12 · line 3 ·" in capsys.readouterr().out


def test_episode_without_an_index_is_counted_by_line_order(batch, tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    records = [json.loads(t.to_json()) for t in batch]
    for r in records:
        del r["info"]["index"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert kept_ids(path, Selection("ids", 1, [1])) == ([1], [2])


def test_informative_picks_across_a_big_file(batch, tmp_path):
    path = big_file(batch, tmp_path / "big.jsonl", 300)
    scanned = scan(path, Selection("informative", 3))
    reasons = [scanned.kept[i][2] for i in scanned.shown]
    assert "the lowest-reward failure" in reasons[0]
    assert len(scanned.shown) == 3 and len({scanned.kept[i][1] for i in scanned.shown}) == 3


# -- values ----------------------------------------------------------------------------------------

def test_values_match_the_serial_reference(view):
    from tests.helpers.reference_returns import (
        discounted_returns_ref,
        returns_ignore_mask_ref,
        returns_reset_at_observation_ref,
    )

    v = view.values
    rewards, spans = v.token_level_rewards, v.batch["spans"]
    # rewards: outcome on each row's last assistant token, turn rewards on each turn's last one
    for row, traj in enumerate(view.trajectories):
        expected = [0.0] * rewards.shape[1]
        assistant = [p for p, s in enumerate(traj.spans) if s == SpanKind.ASSISTANT]
        expected[assistant[-1]] += traj.reward
        for turn, r in enumerate(traj.turn_rewards or []):
            expected[max(p for p in assistant if traj.turn_ids[p] == turn)] += r
        assert rewards[row].tolist() == pytest.approx(expected)
    close = dict(rtol=1e-5, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(v.compare["carry-through"], discounted_returns_ref(rewards, spans, 0.9), **close)
    torch.testing.assert_close(v.compare["reset-at-observation"],
                               returns_reset_at_observation_ref(rewards, spans == SpanKind.ASSISTANT, 0.9), **close)
    torch.testing.assert_close(v.compare["ignore-mask"], returns_ignore_mask_ref(rewards, 0.9), **close)
    torch.testing.assert_close(v.returns, v.compare["carry-through"])
    # REINFORCE++ advantages: returns whitened over the file's assistant tokens (unbiased variance)
    on = [float(x) for x in v.returns[spans == SpanKind.ASSISTANT]]
    mean, var = statistics.fmean(on), statistics.variance(on)
    expected = [[(float(r) - mean) / math.sqrt(var + 1e-8) if s == SpanKind.ASSISTANT else 0.0
                 for r, s in zip(rr, ss)] for rr, ss in zip(v.returns, spans)]
    torch.testing.assert_close(v.advantages, torch.tensor(expected), **close)


@pytest.mark.parametrize("estimator, label", [("reinforce_plus_plus_ignore_mask", "ignore-mask"),
                                              ("reinforce_plus_plus_reset_at_observation", "reset-at-observation")])
def test_estimator_option_picks_the_returns_and_advantages_shown(rollouts, estimator, label):
    """``--estimator``: the returns shown are that registry entry's (serial references), whitened with the
    whole file's moments of those same returns; the terminal says which."""
    from tests.helpers.reference_returns import returns_ignore_mask_ref, returns_reset_at_observation_ref, whiten_ref

    parser = argparse.ArgumentParser()
    inspect_cli.add_arguments(parser)
    args = parser.parse_args([str(rollouts), "--estimator", estimator, "--gamma", "0.9"])
    scanned = scan(rollouts, Selection("all", 100), gamma=0.9, estimator=inspect_cli.LABEL[args.estimator])
    v = build_view(scanned).values
    rewards, spans = v.token_level_rewards, v.batch["spans"]
    assistant = spans == SpanKind.ASSISTANT
    if label == "ignore-mask":
        expected = returns_ignore_mask_ref(rewards, 0.9)
    else:
        expected = returns_reset_at_observation_ref(rewards, assistant, 0.9)
    close = dict(rtol=1e-5, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(v.returns, expected, **close)
    assert (v.returns - v.compare["carry-through"])[assistant].abs().max() > 1e-3  # the choice shows
    torch.testing.assert_close(v.advantages, whiten_ref(expected, spans), **close)  # every row kept: file moments
    assert re.search(rf"returns[\s│]+{label}", render_text(build_view(scanned)))


def test_gamma_recorded_in_the_file_is_the_default(batch, tmp_path):
    path = tmp_path / "r.jsonl"
    records = [json.loads(t.to_json()) for t in batch]
    for r in records:
        r["info"]["gamma"] = 0.8
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    scanned = scan(path, Selection("all", 10))
    assert (scanned.stats.gamma, scanned.gamma_note) == (0.8, "recorded in the file")
    shown = build_view(scanned)
    assert shown.values.gamma == 0.8
    fig = plots.figure(shown)
    assert "returns with gamma 0.8 (recorded in the file)" in fig._suptitle.get_text()
    import matplotlib.pyplot as plt

    plt.close(fig)
    # the option wins, and the views say what the file records
    assert scan(path, Selection("all", 10), gamma=1.0).gamma_note == "--gamma; the file records 0.8"
    assert scan(path, Selection("all", 10), gamma=0.8).gamma_note == "--gamma, as the file records"
    records[1]["info"]["gamma"] = 0.5  # a file appended to by a run with another gamma
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    scanned = scan(path, Selection("all", 10))
    assert scanned.stats.gamma == 0.8  # the first episode's
    assert scanned.gamma_note == "recorded in the file; its episodes record 0.5, 0.8: one gamma used for all"


def test_streamed_whitening_equals_the_whole_batch(batch, tmp_path, monkeypatch):
    """Chunks of 2 episodes, one episode shown: its advantages are those of REINFORCE++ on the whole file."""
    from agent_loop.runners.batch import trajectories_to_batch

    monkeypatch.setattr(view_module, "CHUNK", 2)
    path = big_file(batch, tmp_path / "r.jsonl", 7)
    every = [t for _, t in read_all(path)[0]]
    whole = trajectories_to_batch(every)
    adv, _ = advantages.reinforce_plus_plus(whole["token_level_rewards"], whole["response_mask"], 0.9,
                                            spans=whole["spans"])
    shown = build_view(scan(path, Selection("ids", 1, [4]), gamma=0.9))
    n = len(every[4].response_ids)
    torch.testing.assert_close(shown.values.advantages[0, :n], adv[4, :n], rtol=1e-5, atol=1e-6)


def test_reward_tensors_equal_the_collated_batch(batch):
    from agent_loop.inspect.values import reward_tensors
    from agent_loop.runners.batch import trajectories_to_batch

    light, full = reward_tensors(batch), trajectories_to_batch(batch)
    assert torch.equal(light["spans"], full["spans"])
    assert torch.equal(light["token_level_rewards"], full["token_level_rewards"])


def test_design_worked_example():
    """docs/design.md section 3: gamma 0.5, spans [A, A, O, O, A] (+ padding from a longer row), reward 2 at t=4."""
    A, O = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION)
    example = Trajectory([1], [10, 11, 12, 13, 14], [A, A, O, O, A], [0] * 5, [0.0] * 5, [], reward=2.0)
    longer = Trajectory([1], [10] * 7, [A] * 7, [0] * 7, [0.0] * 7, [], reward=0.0)
    v = compute_values([example, longer], gamma=0.5)
    assert v.compare["carry-through"][0].tolist() == [0.5, 1.0, 0, 0, 2.0, 0, 0]
    assert v.compare["reset-at-observation"][0].tolist() == [0, 0, 0, 1.0, 2.0, 0, 0]
    assert v.compare["ignore-mask"][0].tolist() == [0.125, 0.25, 0.5, 1.0, 2.0, 0, 0]


# -- terminal --------------------------------------------------------------------------------------

def render_text(view, width=120, **options) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    terminal.render(view, console, **options)
    return console.export_text()


def test_terminal_shows_turns_tools_and_tokens(view):
    text = render_text(view)
    lines = text.splitlines()
    for row, traj in enumerate(view.trajectories):
        assert f"episode {traj.info['index']} · line {view.lines[row]} · reward {traj.reward:g}" in text
    n_turns = sum(len(set(t.turn_ids)) for t in view.trajectories)
    assert sum(bool(re.match(r"turn \d+ ─", line)) for line in lines) == n_turns
    assert "unknown_tool: unknown tool 'calc'" in text  # the tool error
    assert "tool calls of turn 0" in text and "│ 391" in text  # a tool result
    assert "The answer is 391.<|im_end|>" in text  # the assistant's tokens, decoded
    assert "<tool_response>↵" in text  # observation tokens with newlines made visible


def test_terminal_colours_every_token_by_span(view):
    for row, traj in enumerate(view.trajectories):
        for _, segs in turns(traj):
            for seg in segs:
                text = terminal.segment_text(view, row, seg)
                styles = [str(s.style) for s in text.spans]
                assert len(styles) == seg.end - seg.start
                assert set(styles) <= set(terminal.TOKEN_STYLES[SpanKind(seg.span)])


def test_terminal_at_80_columns_tables_do_not_wrap(view):
    text = render_text(view, width=80, values=True, compare=True)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    # every table row is one line: each tool call, each summary metric, each estimator
    calls = [c for t in view.trajectories for c in t.tool_calls]
    assert sum(1 for line in lines if re.match(r"│ (calculator|calc) ", line)) == len(calls)
    for metric in ("success rate", "mean reward", "finish reasons", "tool calls", "tokens", "gamma", "shown"):
        assert sum(1 for line in lines if re.match(rf"│ {metric}\s+│ \S", line)) == 1, metric
    assert re.search(r"│ finish reasons │ stop 2, max_turns 1\s+│", text)
    for name in COMPARED:
        assert sum(1 for line in lines if line.startswith(f"│ {name} ")) == 1
    # value tables: one line per assistant token
    n_assistant = span_count(view.trajectories, SpanKind.ASSISTANT)
    assert sum(1 for line in lines if re.match(r"│\s+\d+ │ '", line)) == n_assistant


def test_terminal_value_tables(view):
    text = render_text(view, values=True)
    v = view.values
    for row, traj in enumerate(view.trajectories):
        for pos, span in enumerate(traj.spans):
            if span == SpanKind.ASSISTANT:  # one table row per assistant token, with its values
                cells = [str(pos), repr(view.pieces[row][pos]), str(traj.response_ids[pos])]
                assert re.search(r"│\s+" + r"\s+│\s+".join(map(re.escape, cells)) + r"\s+│", text), (row, pos)
        for seg in segments(traj):
            if seg.span == SpanKind.OBSERVATION:  # the run in one row, with the R carried across it
                carried = float(v.returns[row, seg.end])
                assert re.search(rf"{seg.start}-{seg.end - 1} │ observation × {seg.end - seg.start}\s.*"
                                 + re.escape(f"R={terminal._fmt(carried)} carried"), text), (row, seg)
    last = max(p for p, s in enumerate(view.trajectories[0].spans) if s == SpanKind.ASSISTANT)
    assert f"{float(v.returns[0, last]):+.3f}" in text


def test_terminal_compare_shows_where_the_estimators_differ(view):
    text = render_text(view, width=160, compare=True)
    v = view.values
    assistant = v.batch["spans"] == SpanKind.ASSISTANT
    n = int(assistant.sum())
    for name in COMPARED:
        differ = int(((v.compare[name] - v.compare["carry-through"]).abs() > 1e-6)[assistant].sum())
        assert re.search(rf"{name}\s.*\s{differ} / {n}\s", text), name
    # the first turn of episode 12 gets its reward under carry-through only
    first = segments(view.trajectories[2])[0]
    carry, reset = (float(v.compare[k][2, first.start]) for k in ("carry-through", "reset-at-observation"))
    assert carry > 0 and reset == 0
    assert re.search(rf"0\s+│ ass\s+│ {first.start}-{first.end - 1}\s+│\s+{carry:.3f}→", text)


def test_terminal_default_is_a_summary_and_a_few_episodes(batch, tmp_path, capsys):
    path = big_file(batch, tmp_path / "big.jsonl", 32)
    assert main([str(path), "--width", "80", "--tokenizer", batch[0].info["model_path"]]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^episode \d+ · line", out, re.M)) == 3
    assert "the 3 most informative of 32 (--all for every one)" in out
    assert "shown as the lowest-reward failure" in " ".join(out.split())  # the header wraps as prose
    assert main([str(path), "--all", "--width", "80", "--tokenizer", batch[0].info["model_path"]]) == 0
    assert len(re.findall(r"^episode \d+ · line", capsys.readouterr().out, re.M)) == 32


# -- HTML ------------------------------------------------------------------------------------------

def test_html_counts_tokens_per_span_and_carries_their_values(view):
    page = html.render(view, compare=True)
    tokens = parse_tokens(page)
    for kind in (SpanKind.ASSISTANT, SpanKind.OBSERVATION):
        name = "assistant" if kind == SpanKind.ASSISTANT else "observation"
        assert sum(t["kind"] == name for t in tokens) == span_count(view.trajectories, kind)
    data = page_data(page)
    v = view.values
    for row, traj in enumerate(view.trajectories):
        mine = [t for t in tokens if t["row"] == row]
        d, n = data["rows"][row], len(traj.response_ids)
        assert len(mine) == n and d["spans"] == "".join(map(str, traj.spans)) and d["ids"] == traj.response_ids
        assert [t["kind"] == "assistant" for t in mine] == [s == SpanKind.ASSISTANT for s in traj.spans]
        assert "".join(t["text"] for t in mine).replace("↵", "") == "".join(view.pieces[row])
        for key, expected in (("ret", v.returns), ("adv", v.advantages), ("r", v.token_level_rewards),
                              ("reset", v.compare["reset-at-observation"]), ("ignore", v.compare["ignore-mask"])):
            assert d[key] == pytest.approx(expected[row, :n].tolist(), rel=1e-3, abs=1e-6), key
        assert d["lp"] == pytest.approx(traj.logprobs, rel=1e-3, abs=1e-6)


def test_html_bytes_per_token(view):
    page = html.render(view)
    n = sum(len(t.response_ids) for t in view.trajectories)
    prompt_bytes = sum(len(html_module.escape(p).encode()) for p in view.prompts)
    assert (len(page.encode()) - prompt_bytes - 30_000) / n < 150  # was ~310 with a data-* attribute per value


def test_html_escapes_hostile_text_and_needs_no_network(view):
    page = html.render(view, compare=True)
    assert HOSTILE not in page
    assert html_module.escape(HOSTILE) in page  # the tool result, shown as text
    assert len(re.findall(r"<script", page, re.I)) == 2  # the page's data block and its own script
    assert not re.search(r"<[^>]*\s(onerror|src)=", page, re.I)  # no tag runs or fetches anything
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)  # no network (the SVG namespace is a name)
    row_text = "".join(t["text"] for t in parse_tokens(page) if t["row"] == 2)
    assert HOSTILE in row_text.replace("↵", "")  # the observation's tokens, as text


def test_html_overview_and_filters(view):
    page = html.render(view)
    n_ok = sum(t.reward > 0 for t in view.trajectories)
    assert f"<td>{n_ok / len(view.trajectories):.3f}</td>" in page  # a 0-1 rate, as every view (issue 49)
    assert '<td class="l">max_turns</td><td>1</td>' in page
    assert "tool error: unknown_tool" in page
    assert page.count('<section class="card episode"') == len(view.trajectories)
    for control in ("f-failed", "f-finish", "f-tools", "f-min", "f-max", "colorbar"):
        assert f'id="{control}"' in page
    assert '<option value="max_turns">' in page
    sections = re.findall(r'<section class="card episode" id="ep-(\d+)" data-row="\d+" data-id="\d+" data-ok="(\d)" '
                          r'data-finish="(\w+)" data-toolerr="(\d+)" data-reward="([\d.]+)"', page)
    assert sections == [("10", "1", "stop", "0", "1"), ("11", "0", "max_turns", "1", "0"), ("12", "1", "stop", "0", "0.5")]


# -- PNG -------------------------------------------------------------------------------------------

def lines_by_gid(ax) -> dict:
    return {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_png_draws_carry_through_truthfully(rollouts, gamma):
    """No point of the return line on an observation token; the dashed carried segment spans each
    observation run at the value carry-through holds there; the reset variant drops to 0 before it."""
    import numpy as np

    shown = build_view(scan(rollouts, Selection("all", 100), gamma=gamma, compare=True))
    fig = plots.figure(shown, compare=True)
    try:
        for row, ax in zip(plots.panel_rows(shown), [a for a in fig.axes if a.get_lines()]):
            traj, lines = shown.trajectories[row], lines_by_gid(ax)
            spans = np.asarray(traj.spans)
            x, y = (np.asarray(a, dtype=float) for a in lines["return"].get_data())
            assert (x == np.arange(len(spans))).all()
            obs = spans == SpanKind.OBSERVATION
            assert np.isnan(y[obs]).all() and not np.isnan(y[~obs]).any()
            np.testing.assert_allclose(y[~obs], shown.values.returns[row, :len(spans)].numpy()[~obs], rtol=1e-6)
            cx, cy = (np.asarray(a, dtype=float) for a in lines["carried"].get_data())
            runs = [s for s in segments(traj) if s.span == SpanKind.OBSERVATION]
            assert len(cx) == 3 * len(runs)
            for k, seg in enumerate(runs):
                held = float(shown.values.returns[row, seg.end]) if seg.end < len(spans) else 0.0
                assert (cx[3 * k], cx[3 * k + 1]) == (seg.start - 0.5, seg.end - 0.5)
                assert cy[3 * k] == cy[3 * k + 1] == pytest.approx(held)
                # carry-through: the last assistant token before the run is r + gamma * R held
                before = float(shown.values.returns[row, seg.start - 1])
                reward = float(shown.values.token_level_rewards[row, seg.start - 1])
                assert before == pytest.approx(reward + gamma * held, rel=1e-5)
                # reset-at-observation drops: R is 0 there, so the token before holds only its reward
                rx, ry = (np.asarray(a, dtype=float) for a in lines["return:reset-at-observation"].get_data())
                assert ry[seg.start - 1] == pytest.approx(reward, abs=1e-6)
                if held > 0:
                    assert ry[seg.start - 1] < y[seg.start - 1]
                assert np.isnan(ry[seg.start:seg.end]).all()
                zx, zy = (np.asarray(a, dtype=float) for a in lines["carried:reset-at-observation"].get_data())
                assert zy[3 * k] == zy[3 * k + 1] == 0.0
        assert f"gamma {gamma:g} (--gamma)" in fig._suptitle.get_text()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_png_marks_zero_return_failures_and_left_out_episodes(batch, tmp_path):
    path = big_file(batch, tmp_path / "big.jsonl", 12)
    shown = build_view(scan(path, Selection("all", 100)))
    fig = plots.figure(shown)
    try:
        axes = [a for a in fig.axes if a.get_lines()]
        assert len(axes) == plots.MAX_EPISODE_PLOTS
        rows = plots.panel_rows(shown)  # the 8 episodes with nonzero values; the 4 flat failures left out
        assert not any(plots.flat(shown, r) for r in rows) and rows == [r for r in shown.selected if not plots.flat(shown, r)]
        assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
        for row, ax in zip(rows, axes):
            note = [t for t in ax.texts if t.get_gid() == "zero-note"]
            zero = shown.trajectories[row].reward == 0 and not shown.trajectories[row].turn_rewards
            assert bool(note) == zero
            if zero:
                assert "failed: every return is 0" in note[0].get_text()
                assert "FAILED" in ax.get_title(loc="left")
        title = " ".join(fig._suptitle.get_text().split())  # the title wraps to the figure's width
        assert "8 of 12 episodes shown (4 left out, 4 of them with all values 0" in title
        assert "gamma 1 (default; the file records none, set --gamma)" in title
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_png_is_written(view, tmp_path):
    from matplotlib.image import imread

    path = tmp_path / "out.png"
    plots.render(view, path, compare=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[0] > 400 and image.shape[1] > 800
    assert float(image[..., :3].std()) > 0.05  # not a blank canvas


# -- two runs --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_runs(tokenizer, tmp_path_factory):
    from tests.helpers.inspect_runs import write_run

    folder = tmp_path_factory.mktemp("runs")
    a, b = folder / "before.jsonl", folder / "after.jsonl"
    before, after = write_run(tokenizer, a, "before", 10), write_run(tokenizer, b, "after", 10)
    return a, b, before, after


def test_compare_two_runs_matches_by_index_and_seed(two_runs):
    from agent_loop.inspect.runs import compare, first_divergence

    a, b, before, after = two_runs
    c = compare(a, b, show_all=True)
    assert len(c.pairs) == 10 and c.only == ([], [])
    for p in c.pairs:  # matched on (index, seed), whatever the line order of each file
        ta = next(t for t in before if t.info["index"] == p.a.index)
        tb = next(t for t in after if t.info["index"] == p.a.index)
        assert (p.a.index, p.a.seed) == (p.b.index, p.b.seed) == (tb.info["index"], tb.info["seed"])
        assert (p.a.success, p.b.success, p.a.reward, p.b.reward) == (
            ta.info["success"], tb.info["success"], ta.reward, tb.reward)
        expected = next((k for k, (x, y) in enumerate(zip(ta.response_ids, tb.response_ids)) if x != y),
                        None if ta.response_ids == tb.response_ids else min(len(ta.response_ids), len(tb.response_ids)))
        assert p.divergence == expected
    assert any(p.a.success != p.b.success for p in c.pairs)  # the script's runs do differ
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([1], [1]) is None


def test_compare_two_runs_terminal(two_runs, capsys):
    a, b, before, after = two_runs
    assert main([str(a), str(b), "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert re.search(r"│ success rate\s+│\s+[01]\.\d{3} │\s+1\.000 │", out)  # a 0-1 rate, as every view (issue 49)
    changed = [t.info["index"] for t, u in zip(sorted(before, key=lambda t: t.info["index"]),
                                                 sorted(after, key=lambda t: t.info["index"]))
               if t.reward != u.reward]
    for index in changed[:3]:
        assert re.search(rf"^episode {index} \(seed 3\): A line \d+ FAIL 0 \d+t · B line \d+ ok 1 \d+t", out, re.M)
    assert "first divergence at response position" in out
    assert len(re.findall(r"^│\s+\d+ │\s+3 │ ", out, re.M)) == 10  # one row per matched pair


def test_compare_mismatched_runs(two_runs, tmp_path, capsys):
    a, _, before, _ = two_runs
    other = tmp_path / "other.jsonl"
    shifted = [json.loads(t.to_json()) for t in before]
    for r in shifted:
        r["info"]["seed"] = 99
    other.write_text("".join(json.dumps(r) + "\n" for r in shifted))
    assert main([str(a), str(other), "--quiet"]) == 1
    assert "no episode of A matches one of B" in capsys.readouterr().err
    # B has only some of A's episodes (and one twice): the rest are counted, the duplicate named
    from agent_loop.inspect.runs import compare

    part = tmp_path / "part.jsonl"
    lines = a.read_text().splitlines()
    part.write_text("\n".join(lines[:4] + [lines[0]]) + "\n")
    c = compare(a, part)
    assert len(c.pairs) == 4 and (len(c.only[0]), len(c.only[1])) == (6, 0)
    assert [p.b.line for p in c.pairs] == sorted([1, 2, 3, 4], key=lambda k: json.loads(lines[k - 1])["info"]["index"])
    assert any(f"{part}:5: episode" in m and "again" in m for m in c.problems)


# -- the command -----------------------------------------------------------------------------------

def test_main_writes_everything(rollouts, tmp_path, capsys):
    out_html, out_png = tmp_path / "a.html", tmp_path / "a.png"
    assert main([str(rollouts), "--compare", "--values", "--width", "100", "--gamma", "0.9",
                 "--html", str(out_html), "--png", str(out_png), "--worst"]) == 0
    out = capsys.readouterr().out
    assert "episode 11 · line 2" in out and "episode 10 · line 1" not in out  # --worst: the lowest reward
    assert "ignore-mask" in out
    assert out_html.read_text().count('<section class="card episode"') == 1
    assert out_png.stat().st_size > 10_000

    assert main([str(rollouts), "--quiet", "--all", "--max-episodes", "2", "--html", str(out_html)]) == 0
    page = out_html.read_text()
    assert page.count('<section class="card episode"') == 2
    assert "this page holds 2 of the 3 episodes that match the selection" in page


@pytest.mark.slow
def test_python_dash_m(rollouts, tmp_path):
    result = subprocess.run([sys.executable, "-m", "agent_loop.inspect", str(rollouts), "--episode", "10", "--width", "90"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "episode 10 · line 1" in result.stdout and "turn 1" in result.stdout
