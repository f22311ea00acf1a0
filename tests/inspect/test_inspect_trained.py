"""agent-loop inspect of a trainer's step file (rollouts/step_NNNNNN.jsonl): episodes that carry the
returns and advantages a step used are shown with exactly those values, and the file's recorded gamma,
estimator and lam are the defaults. Trajectories come from the real runner (tests/helpers/inspect_runs.py: the
real Qwen2.5 tokenizer and chat template, the arithmetic task, a scripted backend)."""

from __future__ import annotations

import json
import re

import pytest

from agent_loop.cli.inspect import main
from agent_loop.inspect import html, plots
from agent_loop.inspect.view import Selection, build_view, scan
from agent_loop.types import Trajectory
from masking.spans import SpanKind


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)


def known_values(traj: Trajectory, shift: int) -> tuple[list[float], list[float]]:
    """Returns and advantages no estimator would give (exact in binary, 3 decimals), 0 on observations."""
    a = [s == SpanKind.ASSISTANT for s in traj.spans]
    returns = [0.125 * ((k + shift) % 8) + 0.5 if a[k] else 0.0 for k in range(len(a))]
    advs = [-0.25 * ((k + shift) % 5) - 0.125 if a[k] else 0.0 for k in range(len(a))]
    return returns, advs


def step_file(path, trajectories, step: int, trained_upto: int | None = None):
    """Write ``trajectories`` as a trainer's step file: the first ``trained_upto`` carry known values."""
    out = []
    for i, t in enumerate(trajectories):
        t = Trajectory.from_json(t.to_json())
        t.info.update(step=step, estimator="reinforce_plus_plus", gamma=0.9, trained=True)
        if trained_upto is None or i < trained_upto:
            t.returns, t.advantages = known_values(t, step + i)
        else:
            t.info["trained"] = False
        out.append(t)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(t.to_json() + "\n" for t in out))
    return out


@pytest.fixture(scope="module")
def steps(tokenizer, tmp_path_factory):
    from tests.helpers.inspect_runs import write_run

    folder = tmp_path_factory.mktemp("train")
    played = write_run(tokenizer, folder / "played.jsonl", "before", 6)
    one = step_file(folder / "rollouts" / "step_000001.jsonl", played, 1)
    two = step_file(folder / "rollouts" / "step_000002.jsonl", played, 2, trained_upto=4)
    return folder, one, two


def value_rows(text: str) -> dict[int, tuple[str, str]]:
    """pos -> (return, advantage) cells of the terminal's value tables."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(cells) == 7 and cells[0].isdigit():
            out[int(cells[0])] = (cells[5], cells[6])
    return out


def fmt(x: float) -> str:
    return f"{x:+.3f}" if x else "0"


def test_step_file_values_are_shown_as_trained(steps, capsys, tmp_path):
    folder, _, two = steps
    path = folder / "rollouts" / "step_000002.jsonl"
    out_html = tmp_path / "step.html"
    target = two[1]
    assert main([str(path), "--episode", str(target.info["index"]), "--values", "--width", "220",
                 "--html", str(out_html)]) == 0
    text = capsys.readouterr().out
    assert "as trained at step 2, estimator reinforce_plus_plus" in text
    assert "4 of 6 episodes carry the step's returns and advantages" in text
    rows = value_rows(text)
    assistant = [k for k, s in enumerate(target.spans) if s == SpanKind.ASSISTANT]
    assert sorted(rows) == assistant
    for k in assistant:
        assert rows[k] == (fmt(target.returns[k]), fmt(target.advantages[k])), k
    data = json.loads(re.search(r'id="data">(.*?)</script>', out_html.read_text(), re.S).group(1))
    (row,) = data["rows"]
    assert row["ret"] == html.numbers(target.returns) and row["adv"] == html.numbers(target.advantages)
    assert "as trained at step 2, estimator reinforce_plus_plus" in out_html.read_text()


def test_untrained_rows_are_computed_and_say_so(steps):
    folder, _, two = steps
    scanned = scan(folder / "rollouts" / "step_000002.jsonl", Selection("all", 10), gamma=None, estimator=None)
    view = build_view(scanned)
    assert view.values.recorded == [True] * 4 + [False] * 2
    for row in range(4):
        n = len(two[row].response_ids)
        assert view.values.returns[row, :n].tolist() == two[row].returns
        assert view.values.advantages[row, :n].tolist() == two[row].advantages
    computed = build_view([Trajectory.from_json(two[4].to_json())], gamma=0.9)
    assert view.values.returns[4, :len(two[4].response_ids)].tolist() == pytest.approx(
        computed.values.returns[0, :len(two[4].response_ids)].tolist())
    assert (view.stats.gamma, view.gamma_note) == (0.9, "recorded in the file")
    fig = plots.figure(view)
    assert "as trained at step 2" in " ".join(fig._suptitle.get_text().split())  # the title wraps
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_two_step_files_are_compared(steps, capsys):
    folder, one, _ = steps
    a, b = (folder / "rollouts" / f"step_00000{k}.jsonl" for k in (1, 2))
    assert main([str(a), str(b), "--width", "200"]) == 0
    text = capsys.readouterr().out
    assert f"matched episodes ({len(one)} of {len(one)} listed)" in text
    assert "values differ" in text  # the same tokens, other advantages: the table says what differs


@pytest.mark.parametrize("given, name, note", [
    (None, "ignore-mask", "recorded in the file, lam 0.95"),
    ("reinforce_plus_plus", "carry-through", "--estimator; the file records reinforce_plus_plus_ignore_mask, lam 0.95"),
    ("reinforce_plus_plus_ignore_mask", "ignore-mask", "--estimator"),
])
def test_recorded_estimator_is_the_default(steps, tmp_path, given, name, note):
    folder, one, _ = steps
    path = tmp_path / "r.jsonl"
    records = [json.loads(t.to_json()) for t in one]
    for r in records:
        r["info"].update(estimator="reinforce_plus_plus_ignore_mask", lam=0.95)
        r["returns"] = r["advantages"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    scanned = scan(path, Selection("all", 10), estimator=given)
    assert (scanned.stats.estimator, scanned.estimator_note) == (name, note)


def test_unknown_recorded_estimator_says_what_was_computed(steps, tmp_path, capsys):
    folder, one, _ = steps
    path = tmp_path / "r.jsonl"
    records = [json.loads(t.to_json()) for t in one]
    for r in records:
        r["info"]["estimator"] = "grpo"
        r["returns"] = r["advantages"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(path), "--width", "300"]) == 0
    assert "the file records grpo, which the views do not compute" in capsys.readouterr().out
