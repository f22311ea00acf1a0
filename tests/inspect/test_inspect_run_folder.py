"""``agent-loop inspect RUN_FOLDER`` (issue 40 item 3): a training run over its steps, from the files ``train``
writes (metrics.jsonl by agent_loop.training.metrics.MetricsLogger, step files by agent_loop.training.rollout_files), as a table, a PNG
and an HTML page; two step files of one run matched by prompt; the two-run table at 80 and 120 columns (item 6).
Episodes come from the real runner (tests/helpers/inspect_runs.py: the real Qwen2.5 tokenizer and chat template)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from agent_loop.cli.inspect import main
from agent_loop.inspect import steps as steps_view
from masking.spans import SpanKind


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)


def with_values(trajectories, step: int, first_index: int):
    """The episodes as a step file holds them: new indices (each step plays new ones), returns and advantages."""
    out = []
    for k, t in enumerate(trajectories):
        advantages = [0.25 * ((i + step + k) % 5) - 0.5 if s == SpanKind.ASSISTANT else 0.0
                      for i, s in enumerate(t.spans)]
        info = {**t.info, "index": first_index + k, "step": step, "trained": True, "gamma": 1.0,
                "estimator": "reinforce_plus_plus"}
        out.append(dataclasses.replace(t, info=info, returns=list(advantages), advantages=advantages))
    return out


def reference_advantage(trajectories):
    """Serial: mean, std, min, max of the advantages over ASSISTANT tokens."""
    values = [a for t in trajectories for a, s in zip(t.advantages, t.spans) if s == SpanKind.ASSISTANT]
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5, min(values), max(values)


@pytest.fixture(scope="module")
def run_folder(tokenizer, tmp_path_factory):
    """Steps 1-4 as ``train`` logs them; step files for steps 2 and 4 only (--save-rollouts-every 2), and
    step 5 only as a step file (its metrics line lost)."""
    from agent_loop.training.metrics import MetricsLogger, rollout_metrics
    from agent_loop.training.rollout_files import write_step
    from tests.helpers.inspect_runs import write_run

    folder = tmp_path_factory.mktemp("train")
    before = write_run(tokenizer, folder / "before.jsonl", "before", 6)
    after = write_run(tokenizer, folder / "after.jsonl", "after", 6)
    played = {1: before, 2: before, 3: after, 4: after, 5: after}
    episodes = {step: with_values(played[step], step, 6 * (step - 1)) for step in played}
    logger = MetricsLogger(folder, tensorboard=False)
    for step in (1, 2, 3, 4):
        mean, std, low, high = reference_advantage(episodes[step])
        logger.log(step, {**rollout_metrics(episodes[step]), "ppo_kl": 1e-3 * step, "advantages/mean": mean,
                          "advantages/std": std, "advantages/min": low, "advantages/max": high,
                          **({"eval/success": 0.25 * step} if step % 2 == 0 else {})})
    logger.close()
    for step in (2, 4, 5):
        write_step(folder, step, episodes[step])
    return folder, episodes


def test_read_run_gives_every_step_from_metrics_and_step_files(run_folder):
    folder, episodes = run_folder
    run = steps_view.read_run(folder)
    assert [r.step for r in run.rows] == [1, 2, 3, 4, 5] and run.problems == []
    for row in run.rows:
        ts = episodes[row.step]
        assert row.success == pytest.approx(sum(t.success for t in ts) / len(ts))
        assert row.reward == pytest.approx(sum(t.reward for t in ts) / len(ts))
        assert row.turns == pytest.approx(sum(len(set(t.turn_ids)) for t in ts) / len(ts))
        assert row.tool_errors == sum(1 for t in ts for c in t.tool_calls if c.error_kind)
        finish = {r: sum(t.finish_reason == r for t in ts) / len(ts) for r in {t.finish_reason for t in ts}}
        assert row.finish == pytest.approx(finish)
        assert row.advantage == pytest.approx(reference_advantage(ts))
        assert row.episodes == (6 if row.step in (2, 4, 5) else None)
    assert [r.ppo_kl for r in run.rows] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, None])
    assert [r.eval_success for r in run.rows] == [None, 0.5, None, 1.0, None]
    assert run.rows[4].source == "step file" and run.rows[1].source == "metrics + step file"


def test_the_run_folder_as_a_table_a_png_and_a_page(run_folder, tmp_path, capsys):
    folder, episodes = run_folder
    png, page = tmp_path / "run.png", tmp_path / "run.html"
    assert main([str(folder), "--width", "80", "--png", str(png), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    rows = [line for line in out.splitlines() if re.match(r"^│\s+\d+ │", line)]
    assert len(rows) == 5  # one line per step
    header = next(line for line in out.splitlines() if "step" in line and "┃" in line)
    names = [c.strip() for c in header.strip("┃").split("┃")]
    # every key column at 80 (issue 40 item 3: success, reward, turns, tool errors, finish, advantage, KL)
    assert names == ["step", "succ", "reward", "turns", "errs", "finish", "adv±std", "kl", "eval"], names
    for line, step in zip(rows, (1, 2, 3, 4, 5)):
        ts = episodes[step]
        cell = dict(zip(names, (c.strip() for c in line.strip("│").split("│"))))
        assert cell["step"] == str(step) and cell["succ"] == f"{sum(t.success for t in ts) / len(ts):.3f}"
        assert cell["reward"] == f"{sum(t.reward for t in ts) / len(ts):.3f}"
        assert cell["errs"] == str(sum(1 for t in ts for c in t.tool_calls if c.error_kind))
        assert cell["kl"] == (f"{1e-3 * step:.1e}" if step < 5 else "-")
        assert cell["adv±std"] == "{:+.2f}±{:.2f}".format(*reference_advantage(ts)[:2])
        assert cell["finish"].startswith("stop")
    assert "left out at 80 columns: calls, eps" in " ".join(out.split())
    words = " ".join(out.split())  # the caption wraps
    assert "sampled success" in words and "greedy eval success 0.500 -> 1.000 (held-out prompts)" in words
    html = page.read_text()
    assert html.count("<tr data-step=") == 5 and "data:image/png;base64," in html and png.stat().st_size > 20_000

    fig = steps_view.figure(steps_view.read_run(folder))
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    success = [sum(t.success for t in episodes[s]) / 6 for s in (1, 2, 3, 4, 5)]
    assert np.allclose(lines["success"].get_ydata(), success)
    assert np.allclose(lines["advantage"].get_ydata(), [reference_advantage(episodes[s])[0] for s in (1, 2, 3, 4, 5)])
    assert np.allclose(lines["ppo_kl"].get_ydata()[:4], [1e-3, 2e-3, 3e-3, 4e-3])


def test_run_folder_usage_errors(run_folder, tmp_path, capsys):
    folder, _ = run_folder
    assert main([str(folder), "--episode", "3"]) == 2
    assert "is a run folder, shown over its steps" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "without metrics.jsonl or rollouts/step_NNNNNN.jsonl" in capsys.readouterr().err


def test_two_steps_of_a_run_are_matched_by_prompt(run_folder, capsys):
    """Steps 2 and 4 played new indices (6-11 and 18-23) of the same prompts: matched by prompt, by default."""
    from agent_loop.inspect.runs import compare

    folder, episodes = run_folder
    a, b = folder / "rollouts" / "step_000002.jsonl", folder / "rollouts" / "step_000004.jsonl"
    c = compare(a, b)
    assert c.match == "prompt" and len(c.pairs) == 6 and c.only == ([], [])
    for p in c.pairs:
        ta = next(t for t in episodes[2] if t.info["index"] == p.a.index)
        tb = next(t for t in episodes[4] if t.info["index"] == p.b.index)
        assert ta.prompt_ids == tb.prompt_ids and p.b.index == p.a.index + 12
    assert main([str(a), str(b), "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "matched by prompt" in out and re.search(r"│\s+6→18 │", out)
    assert main([str(a), str(b), "--match", "index", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no episode of A matches one of B by (info.index, info.seed): two steps of a run play new indices; " \
           "--match prompt pairs the episodes of the same prompt" in " ".join(err.split())


@pytest.mark.parametrize("width", [80, 120])
def test_the_two_run_table_keeps_its_key_columns_on_one_line(run_folder, width, capsys):
    """Issue 40 item 6: at 80 and 120 columns every pair is one line with its episode, seed, A and B whole."""
    folder, _ = run_folder
    a, b = folder / "before.jsonl", folder / "after.jsonl"
    before = {json.loads(line)["info"]["index"]: json.loads(line) for line in a.read_text().splitlines()}
    after = {json.loads(line)["info"]["index"]: json.loads(line) for line in b.read_text().splitlines()}
    assert main([str(a), str(b), "--width", str(width), "--all"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= width
    rows = [line for line in out.splitlines() if re.match(r"^│\s+\d+ │", line)]
    assert len(rows) == 6
    for line in rows:
        episode, seed, cell_a, cell_b, differs = (c.strip() for c in line.strip("│").split("│"))
        ta, tb = before[int(episode)], after[int(episode)]
        assert seed == str(ta["info"]["seed"]) and "…" not in cell_a + cell_b
        for cell, t in ((cell_a, ta), (cell_b, tb)):
            assert cell == f"{'ok' if t['info']['success'] else 'FAIL'} {t['reward']:g} {len(set(t['turn_ids']))}t"
        assert differs  # cut with … if it must, never empty
