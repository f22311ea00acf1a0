"""agent-loop inspect: loading (bad input too), terminal, HTML, PNG and --compare on hand-built
trajectories made of real token ids (the shared Qwen2.5 tokenizer and its real chat template)."""

from __future__ import annotations

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

from agent_loop.chat import ChatFormatter
from agent_loop.inspect import html, main, plots, terminal
from agent_loop.inspect.load import load_trajectories
from agent_loop.inspect.tokens import segments, turns
from agent_loop.inspect.values import ESTIMATORS, compute_values
from agent_loop.inspect.view import build_view, select
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
        messages.append(fmt.assistant_message(text, [{"name": c["name"], "arguments": c["arguments"]} for c in calls]))
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
    return Trajectory(prompt_ids, response, [int(s) for s in spans], turn_ids, logprobs, messages, records,
                      reward=reward, info={"model_path": tokenizer.name_or_path, "task": "calculator"}, **fields)


def call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def batch(tokenizer) -> list[Trajectory]:
    """Three episodes: a success with per-turn rewards, a failure with a tool error, and one whose
    tool result is hostile HTML."""
    calc = {"name": "calculator"}
    return [
        build_trajectory(tokenizer, "What is 17 * 23?", [
            (call("17 * 23"), [{**calc, "arguments": {"expression": "17 * 23"}, "result": "391"}]),
            ("The answer is 391.", []),
        ], reward=1.0, turn_rewards=[0.1, 0.0]),
        build_trajectory(tokenizer, "What is 2 ** 10?", [
            ('<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>',
             [{"name": "calc", "arguments": {"x": 1}, "error_kind": "unknown_tool", "error": "unknown tool 'calc'"}]),
            (call("2 ** 10"), [{**calc, "arguments": {"expression": "2 ** 10"}, "result": "1024"}]),
            ("The answer is 1000.", []),
        ], reward=0.0, finish_reason="max_turns"),
        build_trajectory(tokenizer, "What is 1 + 1?", [
            (call("1 + 1"), [{**calc, "arguments": {"expression": "1 + 1"}, "result": HOSTILE}]),
            ("The answer is 2.", []),
        ], reward=0.5),
    ]




@pytest.fixture(scope="module")
def rollouts(batch, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "rollouts.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in batch))
    return path


@pytest.fixture(scope="module")
def view(rollouts):
    return build_view(load_trajectories(rollouts), gamma=0.9)


def span_count(trajectories: list[Trajectory], kind: SpanKind) -> int:
    return sum(s == kind for t in trajectories for s in t.spans)


class TokenParser(HTMLParser):
    """Collects every ``tok`` element of a page: its classes, data attributes and text."""

    def __init__(self):
        super().__init__()
        self.tokens: list[dict] = []
        self._open = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and "tok" in (attrs.get("class") or "").split():
            self.tokens.append({"class": attrs["class"], "attrs": attrs, "text": ""})
            self._open = True

    def handle_endtag(self, tag):
        if tag == "span":
            self._open = False

    def handle_data(self, data):
        if self._open:
            self.tokens[-1]["text"] += data


def parse_tokens(page: str) -> list[dict]:
    parser = TokenParser()
    parser.feed(page)
    return parser.tokens


# -- loading and bad input -------------------------------------------------------------------------

def test_load_round_trips_the_batch(rollouts, batch):
    loaded = load_trajectories(rollouts)
    assert loaded.problems == []
    assert loaded.trajectories == batch
    assert loaded.lines == [1, 2, 3]


@pytest.mark.slow  # loads the tokenizer once more through main()
def test_bad_lines_are_named_and_good_lines_still_render(rollouts, batch, tmp_path, capsys):
    good = rollouts.read_text().splitlines()
    short_spans = json.loads(good[1])
    short_spans["spans"] = short_spans["spans"][:-1]
    lines = [good[0], '{"prompt_ids": [1]}', "[1, 2]", json.dumps(short_spans), "", good[2],
             good[1][: len(good[1]) // 2]]  # the last line cut off: an interrupted rollout
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines))

    loaded = load_trajectories(bad)
    assert loaded.lines == [1, 6]
    assert loaded.trajectories == [batch[0], batch[2]]
    problems = dict(p.split(": ", 1) for p in loaded.problems)
    assert sorted(problems) == [f"{bad}:{n}" for n in (2, 3, 4, 7)]
    assert "missing keys" in problems[f"{bad}:2"]
    assert "expected a JSON object" in problems[f"{bad}:3"]
    assert "spans has" in problems[f"{bad}:4"]
    assert "truncated last line" in problems[f"{bad}:7"]

    out = tmp_path / "bad.html"
    assert main([str(bad), "--quiet", "--html", str(out)]) == 0
    err = capsys.readouterr().err
    for n in (2, 3, 4, 7):
        assert f"{bad}:{n}" in err
    assert len({t["attrs"]["data-row"] for t in parse_tokens(out.read_text())}) == 2


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("", "empty"),
    ("\n  \n", "empty"),
    ('{"not": "a trajectory"}\n', "not a Trajectory"),
])
def test_nothing_to_render_exits_1_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "rollouts.jsonl"
    if content is not None:
        path.write_text(content)
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_reward_without_an_assistant_token_is_a_bad_line(batch, tmp_path):
    record = json.loads(batch[0].to_json())
    record["spans"] = [int(SpanKind.OBSERVATION)] * len(record["spans"])
    record["turn_rewards"] = None
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record) + "\n" + batch[1].to_json() + "\n")
    loaded = load_trajectories(path)
    assert loaded.lines == [2]
    assert loaded.problems == [f"{path}:1: not a Trajectory: a nonzero reward but no ASSISTANT token to put it on"]


def test_tokenizer_that_cannot_load_falls_back_to_ids(batch, tmp_path):
    traj = Trajectory.from_json(batch[0].to_json())
    traj.info["model_path"] = str(tmp_path / "no-such-model")
    path = tmp_path / "r.jsonl"
    path.write_text(traj.to_json() + "\n")
    view = build_view(load_trajectories(path))
    assert view.pieces[0] == [f"[{i}]" for i in traj.response_ids]
    assert any(str(tmp_path / "no-such-model") in p for p in view.problems)


# -- selection -------------------------------------------------------------------------------------

def test_selectors(batch, rollouts, capsys):
    rewards = [t.reward for t in batch]
    assert select(batch, worst=1) == [rewards.index(min(rewards))]
    assert select(batch, worst=2) == sorted(range(3), key=rewards.__getitem__)[:2]
    assert select(batch, failed=True) == [i for i, t in enumerate(batch) if t.reward <= 0]
    assert select(batch, episodes=[2, 0]) == [2, 0]
    with pytest.raises(ValueError, match="--episode 7 is out of range"):
        select(batch, episodes=[7])
    assert main([str(rollouts), "--episode", "7"]) == 1
    assert "out of range" in capsys.readouterr().err


# -- values ----------------------------------------------------------------------------------------

def test_values_match_the_serial_reference(view):
    from reference_returns import discounted_returns_ref, returns_ignore_mask_ref, returns_reset_at_observation_ref

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
    # REINFORCE++ advantages: returns whitened over the batch's assistant tokens (unbiased variance)
    on = [float(x) for x in v.returns[spans == SpanKind.ASSISTANT]]
    mean, var = statistics.fmean(on), statistics.variance(on)
    expected = [[(float(r) - mean) / math.sqrt(var + 1e-8) if s == SpanKind.ASSISTANT else 0.0
                 for r, s in zip(rr, ss)] for rr, ss in zip(v.returns, spans)]
    torch.testing.assert_close(v.advantages, torch.tensor(expected), **close)


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
        assert f"episode {row} · line {view.lines[row]} · reward {traj.reward:g}" in text
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


def test_terminal_fits_the_width(view):
    for width in (60, 100):
        text = render_text(view, width=width, values=True, compare=True)
        assert max(len(line) for line in text.splitlines()) <= width


def test_terminal_value_tables(view):
    text = render_text(view, values=True)
    v = view.values
    for row, traj in enumerate(view.trajectories):
        for pos, span in enumerate(traj.spans):
            if span == SpanKind.ASSISTANT:  # one table row per assistant token, with its values
                cells = [str(pos), repr(view.pieces[row][pos]), str(traj.response_ids[pos])]
                assert re.search(r"│\s+" + r"\s+│\s+".join(map(re.escape, cells)) + r"\s+│", text), (row, pos)
        for seg in segments(traj):
            if seg.span == SpanKind.OBSERVATION:
                assert f"{seg.start}-{seg.end - 1} │ observation × {seg.end - seg.start}" in text
    last = max(p for p, s in enumerate(view.trajectories[0].spans) if s == SpanKind.ASSISTANT)
    assert f"{float(v.returns[0, last]):+.3f}" in text


def test_terminal_compare_shows_where_the_estimators_differ(view):
    text = render_text(view, width=160, compare=True)
    v = view.values
    assistant = v.batch["spans"] == SpanKind.ASSISTANT
    n = int(assistant.sum())
    for name in ESTIMATORS:
        differ = int(((v.compare[name] - v.compare["carry-through"]).abs() > 1e-6)[assistant].sum())
        assert re.search(rf"{name}\s.*\s{differ} / {n}\s", text), name
    # the first turn of episode 2 gets its reward under carry-through only
    first = segments(view.trajectories[2])[0]
    carry, reset = (float(v.compare[k][2, first.start]) for k in ("carry-through", "reset-at-observation"))
    assert carry > 0 and reset == 0
    assert re.search(rf"0\s+│ assistant\s+│ {first.start}-{first.end - 1}\s+│\s+{carry:.3f} →", text)


# -- HTML ------------------------------------------------------------------------------------------

def test_html_counts_tokens_per_span_and_carries_their_values(view):
    page = html.render(view, compare=True)
    tokens = parse_tokens(page)
    for kind, name in ((SpanKind.ASSISTANT, "assistant"), (SpanKind.OBSERVATION, "observation")):
        assert page.count(f'class="tok tok-{name}"') == span_count(view.trajectories, kind)
        assert sum(t["class"] == f"tok tok-{name}" for t in tokens) == span_count(view.trajectories, kind)
    v = view.values
    i = 0
    for row, traj in enumerate(view.trajectories):
        for pos in range(len(traj.response_ids)):
            attrs = tokens[i]["attrs"]
            assert int(attrs["data-id"]) == traj.response_ids[pos] and int(attrs["data-turn"]) == traj.turn_ids[pos]
            assert float(attrs["data-ret"]) == pytest.approx(float(v.returns[row, pos]), rel=1e-3, abs=1e-6)
            assert float(attrs["data-adv"]) == pytest.approx(float(v.advantages[row, pos]), rel=1e-3, abs=1e-6)
            assert float(attrs["data-lp"]) == pytest.approx(traj.logprobs[pos], rel=1e-3, abs=1e-6)
            assert float(attrs["data-reset"]) == pytest.approx(float(v.compare["reset-at-observation"][row, pos]),
                                                               rel=1e-3, abs=1e-6)
            i += 1
    assert i == len(tokens)


def test_html_escapes_hostile_text_and_needs_no_network(view):
    page = html.render(view, compare=True)
    assert HOSTILE not in page
    assert html_module.escape(HOSTILE) in page  # the tool result, shown as text
    assert len(re.findall(r"<script", page, re.I)) == 1  # only the page's own script
    assert not re.search(r"<[^>]*\s(onerror|src)=", page, re.I)  # no tag runs or fetches anything
    assert not re.search(r"https?://", page)  # no network
    row_text = "".join(t["text"] for t in parse_tokens(page) if t["attrs"]["data-row"] == "2")
    assert HOSTILE in row_text.replace("↵", "")  # the observation's tokens, as text


def test_html_overview(view):
    page = html.render(view)
    n_ok = sum(t.reward > 0 for t in view.trajectories)
    assert f"<td>{n_ok / len(view.trajectories):.0%}</td>" in page
    assert '<td class="l">max_turns</td><td>1</td>' in page
    assert "tool error: unknown_tool" in page
    assert page.count('<section class="card episode"') == len(view.selected)


# -- PNG -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compare", [False, True])
def test_png_is_written(view, tmp_path, compare):
    from matplotlib.image import imread

    path = tmp_path / "out.png"
    plots.render(view, path, compare=compare)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[0] > 400 and image.shape[1] > 800
    assert float(image[..., :3].std()) > 0.05  # not a blank canvas


# -- the command -----------------------------------------------------------------------------------

def test_main_writes_everything(rollouts, tmp_path, capsys):
    out_html, out_png = tmp_path / "a.html", tmp_path / "a.png"
    assert main([str(rollouts), "--compare", "--values", "--width", "100", "--gamma", "0.9",
                 "--html", str(out_html), "--png", str(out_png), "--worst"]) == 0
    out = capsys.readouterr().out
    assert "episode 1 · line 2" in out and "episode 0 · line 1" not in out  # --worst: the lowest reward
    assert "ignore-mask" in out
    assert out_html.read_text().count('<section class="card episode"') == 1
    assert out_png.stat().st_size > 10_000

    assert main([str(rollouts), "--quiet", "--max-episodes", "2", "--html", str(out_html)]) == 0
    assert "showing 2 of 3 selected episodes" in capsys.readouterr().err
    assert out_html.read_text().count('<section class="card episode"') == 2


@pytest.mark.slow
def test_python_dash_m(rollouts, tmp_path):
    result = subprocess.run([sys.executable, "-m", "agent_loop.inspect", str(rollouts), "--episode", "0", "--width", "90"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "episode 0 · line 1" in result.stdout and "turn 1" in result.stdout
