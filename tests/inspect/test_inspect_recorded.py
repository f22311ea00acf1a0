"""Files that say how they were made (issue 29, item 3): every episode of ``agent-loop rollout``'s file
records the gamma, the estimator, the model's absolute path and the resolved options, and
``agent-loop inspect`` uses them (flags still override, and the views say which). The real command on the
built-in tiny agent; then the smaller items of issue 29's point 8 that live in the views (``--worst``
shows values, plurals, what the two-run table says about the pairs it lists and leaves out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agent_loop.cli import main
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.inspect.view import Selection, build_view, scan
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.runners.local import read_trajectories
from agent_loop.tasks.registry import TaskOptions
from agent_loop.types import Trajectory
from masking.spans import SpanKind
from tests.helpers.reference_returns import discounted_returns_ref


@pytest.fixture(scope="module")
def scripted(qwen_tokenizer, tmp_path_factory) -> Path:
    """Six arithmetic episodes from the real runner, the Qwen2.5 tokenizer and a scripted backend."""
    from tests.helpers.inspect_runs import write_run

    path = tmp_path_factory.mktemp("scripted") / "run.jsonl"
    write_run(qwen_tokenizer, path, "before", 6)
    return path


@pytest.fixture(scope="module")
def made(tiny_agent_dir, tmp_path_factory):
    """``agent-loop rollout --model models/tiny --gamma 0.9`` run from ``work/`` (a relative --model), and
    another folder to inspect it from."""
    root = tmp_path_factory.mktemp("recorded")
    work, elsewhere = root / "work", root / "elsewhere"
    (work / "models").mkdir(parents=True)
    elsewhere.mkdir()
    (work / "models" / "tiny").symlink_to(tiny_agent_dir, target_is_directory=True)
    before = os.getcwd()
    os.chdir(work)
    try:
        assert main(["rollout", "--model", "models/tiny", "--episodes", "3", "--gamma", "0.9", "--max-turns", "3",
                     "--out", "r.jsonl", "--concurrency", "3"]) == 0
    finally:
        os.chdir(before)
    return work, elsewhere, work / "r.jsonl"


def inspect_from(folder: Path, capsys, *argv) -> tuple[str, str]:
    before = os.getcwd()
    os.chdir(folder)
    try:
        capsys.readouterr()
        assert main(["inspect", *map(str, argv), "--width", "200"]) == 0
    finally:
        os.chdir(before)
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.slow
def test_each_episode_records_how_it_was_made(made):
    work, _, path = made
    trajectories = read_trajectories(path)
    assert len(trajectories) == 3
    expected_options = {**dataclasses.asdict(LoopConfig()), "max_turns": 3,
                        **{f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                           for f in dataclasses.fields(TaskOptions)}}
    for t in trajectories:
        assert t.info["gamma"] == 0.9 and t.info["estimator"] == "reinforce_plus_plus"
        recorded = Path(t.info["model_path"])  # absolute, the folder as it was named (not the link's target)
        assert recorded.is_absolute() and recorded.parts[-2:] == ("models", "tiny")
        assert recorded.resolve() == (work / "models" / "tiny").resolve()
        assert t.info["options"] == expected_options  # the loop's and the task's options, resolved


@pytest.mark.slow
def test_inspect_uses_the_recorded_gamma_without_a_flag(made, capsys):
    """``rollout --gamma 0.9`` then ``inspect`` of its file: gamma 0.9, said to come from the file; the
    returns shown equal a serial carry-through reference at 0.9, not at the default 1."""
    _, elsewhere, path = made
    out, _ = inspect_from(elsewhere, capsys, path, "--all")
    assert re.search(r"│ gamma\s+│ 0\.9 \(recorded in the file\)", out)
    assert re.search(r"│ returns\s+│ carry-through \(recorded in the file\)", out)
    view = build_view(scan(path, Selection("all", 10), gamma=None, estimator=None))
    batch = trajectories_to_batch(view.trajectories)
    expected = discounted_returns_ref(batch.token_level_rewards, batch.spans, 0.9)
    at_one = discounted_returns_ref(batch.token_level_rewards, batch.spans, 1.0)
    assistant = batch.spans == SpanKind.ASSISTANT
    assert view.stats.gamma == 0.9
    torch.testing.assert_close(view.values.returns[assistant], expected[assistant].to(view.values.returns.dtype))
    assert (expected - at_one)[assistant].abs().max() > 1e-3  # the gamma shows in the values
    # a flag still wins, and the views say what the file records
    out, _ = inspect_from(elsewhere, capsys, path, "--gamma", "0.5")
    assert re.search(r"│ gamma\s+│ 0\.5 \(--gamma; the file records 0\.9\)", out)


@pytest.mark.slow
def test_inspect_from_another_folder_loads_the_tokenizer_of_a_relative_model(made, capsys, tiny_tokenizer):
    _, elsewhere, path = made
    out, err = inspect_from(elsewhere, capsys, path, "--episode", "0")
    assert "cannot load tokenizer" not in err
    first = read_trajectories(path)[0]
    pieces = [tiny_tokenizer.decode([i]) for i in first.response_ids]
    longest = max((p for p in pieces if p.strip() and "\n" not in p), key=len)
    assert len(longest) > 3 and longest in out  # tokens shown as text, not as [ids]
    assert not re.search(r"\[\d+\]\[\d+\]", out)


def test_a_tokenizer_that_does_not_load_names_the_way_out(scripted, tmp_path, monkeypatch):
    """An old record with a relative model path, read from elsewhere: the warning says it is relative,
    read from this working directory, and that --tokenizer names another."""
    monkeypatch.chdir(tmp_path)
    batch_record = read_trajectories(scripted)[0]
    batch_record.info["model_path"] = "runs/models/gone"
    view = build_view([batch_record])
    assert view.pieces[0] == [f"[{i}]" for i in batch_record.response_ids]
    (problem,) = view.problems
    assert "cannot load tokenizer runs/models/gone" in problem and "--tokenizer DIR" in problem
    assert f"a relative path, read from this working directory ({tmp_path})" in problem


def test_the_trainer_step_files_record_the_same_way():
    """Both files record through one function: the trainer's keys are rollout's, plus the estimator's."""
    import agent_loop.training.rollout_files as rollout_files
    from agent_loop.runners.spec import EstimatorOptions, made_with

    options = {**dataclasses.asdict(LoopConfig(max_turns=3)), **dataclasses.asdict(TaskOptions())}
    played_with = SimpleNamespace(**options, tiny_stage="mid")  # the run's options: the loop's and the task's recorded
    step = rollout_files.made_with(EstimatorOptions(estimator="gae", gamma=0.95, lam=0.9), played_with, 0.01)
    assert step == {**made_with(0.95, "gae", options), "lam": 0.9, "kl_coef": 0.01}
    assert step["options"]["max_turns"] == 3  # the options the episodes were played with
    plain = rollout_files.made_with(EstimatorOptions(), played_with)
    assert set(plain) == {"gamma", "estimator", "options"}  # no lam, no kl_coef where they do not apply
    gigpo = rollout_files.made_with(EstimatorOptions(estimator="gigpo", step_advantage_w=0.5), played_with)
    assert (gigpo["step_advantage_w"], gigpo["gigpo_mode"]) == (0.5, "mean_norm") and "lam" not in gigpo
    assert made_with(None, None, None) == {}  # nothing recorded that was not chosen


def test_run_rollouts_records_its_loop_options_and_given_info(qwen_tokenizer, tmp_path):
    """The runner records the loop options of any run (Python API too) and what ``info`` adds."""
    import asyncio

    from agent_loop.backends.scripted import ScriptedBackend
    from agent_loop.runners.local import run_rollouts
    from agent_loop.runners.spec import made_with
    from agent_loop.tasks.builtin import ArithmeticTask

    config = LoopConfig(max_turns=2, temperature=0.5)
    out = tmp_path / "r.jsonl"
    got = asyncio.run(run_rollouts(ArithmeticTask(), ScriptedBackend(lambda ids: qwen_tokenizer.encode("7")),
                                   qwen_tokenizer, range(2), config, output_path=out, progress=False,
                                   info=made_with(gamma=0.5)))
    for t in [*got, *read_trajectories(out)]:
        assert t.info["gamma"] == 0.5 and "estimator" not in t.info
        assert t.info["options"] == dataclasses.asdict(config)
    assert scan(out).gamma_note == "recorded in the file"
    got[0].info["options"]["max_turns"] = 99  # each episode holds its own copy
    assert got[1].info["options"]["max_turns"] == 2


# -- issue 29, point 8: the smaller items in the views ------------------------------------------------

@pytest.mark.slow
def test_worst_alone_shows_values_per_token(made, capsys):
    """README: ``inspect FILE --worst`` shows tokens coloured by span and values per token (no --values)."""
    _, elsewhere, path = made
    out, _ = inspect_from(elsewhere, capsys, path, "--worst")
    assert re.search(r"values of turn 0 \(computed: carry-through, gamma 0\.9\)", out)
    assert re.search(r"pos\s*┃\s*token\s*┃\s*id\s*┃\s*logprob\s*┃\s*reward\s*┃\s*return\s*┃\s*advantage", out)


def test_counts_are_worded_in_the_singular_and_plural(scripted, tmp_path, capsys):
    from agent_loop.cli.tables import failure_summary
    from agent_loop.options import plural
    from agent_loop.runners.stats import RolloutStats

    assert [plural(n, "turn") for n in (0, 1, 2)] == ["0 turns", "1 turn", "2 turns"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
    one = tmp_path / "one.jsonl"
    one.write_text(scripted.read_text().splitlines()[0] + "\n")
    out, _ = inspect_from(tmp_path, capsys, one, "--html", tmp_path / "one.html")
    assert f"{one}: 1 episode\n" in out and "1 episodes" not in out
    assert re.search(r"prompt \(\d+ tokens\)", out)
    assert "file: 1 episode<" in (tmp_path / "one.html").read_text()
    stats = RolloutStats()
    stats.add(Trajectory([1], [5], [int(SpanKind.ASSISTANT)], [0], [0.0], [], finish_reason="length"))
    assert failure_summary(stats).startswith("the 1 episode sampled 1 assistant token in all")


def test_the_two_run_table_says_how_many_positions_differ_and_which(qwen_tokenizer, tmp_path, capsys):
    """Every listed pair that differs says at how many positions and which (the first few); the line under
    the table counts the pairs it leaves out that differ and names them; checked against a plain serial
    comparison of the two files."""
    from agent_loop.inspect.runs import NAMED, TABLE_ROWS
    from tests.helpers.inspect_runs import write_run

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    before = {t.info["index"]: t for t in write_run(qwen_tokenizer, a, "before", 30)}
    after = {t.info["index"]: t for t in write_run(qwen_tokenizer, b, "after", 30)}
    out, _ = inspect_from(tmp_path, capsys, a, b)
    row = re.compile(r"^│\s+(\d+) │\s+3 │[^│]+│[^│]+│([^│]+)│", re.M)
    rows = {int(m.group(1)): m.group(2).strip() for m in row.finditer(out)}
    assert sorted(rows) == list(range(TABLE_ROWS))
    differing = []
    for index in sorted(before):
        x, y = before[index].response_ids, after[index].response_ids
        where = [k for k in range(min(len(x), len(y))) if x[k] != y[k]]  # the serial reference
        if x != y:
            differing.append(index)
        if index not in rows:
            continue
        if x == y:
            assert rows[index] == "same"
        elif where:
            named = ", ".join(map(str, where[:NAMED])) + (", …" if len(where) > NAMED else "")
            count = f"{len(where)} position{'s' if len(where) > 1 else ''}"
            assert rows[index].startswith(f"tokens differ at {count}: {named}"), rows[index]
    left = [i for i in differing if i >= TABLE_ROWS]
    assert left, "the script's runs differ past the listed rows"
    named = ", ".join(map(str, left[:2 * NAMED])) + (", …" if len(left) > 2 * NAMED else "")
    assert (f"({30 - TABLE_ROWS} more matched episodes, {len(left)} of them with differences: episodes {named}; "
            "--all or --episode N lists them)") in " ".join(out.split())
    changed = [i for i in sorted(before) if before[i].success != after[i].success]
    assert f"{len(changed)} matched episodes changed outcome (episodes {', '.join(map(str, changed[:NAMED]))}" in out


def test_two_step_files_say_where_their_values_differ(tmp_path, capsys, scripted):
    """Step files with the same tokens and other advantages: the table names the positions."""
    path = scripted
    records = [json.loads(line) for line in path.read_text().splitlines()]
    files = []
    for name, shift in (("a", 0.0), ("b", 0.5)):
        for r in records:
            n = len(r["response_ids"])
            r["returns"] = [0.0] * n
            r["advantages"] = [shift if k in (2, 5) else 0.0 for k in range(n)]
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    out, _ = inspect_from(tmp_path, capsys, *files)
    assert out.count("values differ at 2 positions: 2, 5") == len(records)
