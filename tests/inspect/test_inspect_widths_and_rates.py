"""The two-run view fits its --width (80 and narrower) with no empty column and cells cut after whole words,
and success is written one way, a 0-1 rate (``agent_loop.options.rate``), in every view (issue 49 items 10, 13)."""

from __future__ import annotations

import re

import pytest

from agent_loop.cli.inspect import main
from agent_loop.inspect.runs import compare, fit_words, tokens_state
from agent_loop.options import rate

BORDERS = "│┃┏┓┗┛┡┩└┘┳┻╇┴┬"


@pytest.fixture(scope="module")
def two_runs(qwen_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.helpers.inspect_runs import write_run

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)
    folder = tmp_path_factory.mktemp("runs")
    a, b = folder / "before.jsonl", folder / "after.jsonl"
    return a, b, write_run(tokenizer, a, "before", 10), write_run(tokenizer, b, "after", 10)


@pytest.mark.parametrize("width", [80, 72, 60, 40, 20])
def test_the_two_run_view_fits_its_width(two_runs, capsys, width):
    a, b, _, _ = two_runs
    assert main([str(a), str(b), "--width", str(width)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    boxed = [line.rstrip() for line in lines if line[:1] in BORDERS]
    assert all(line[-1] in BORDERS for line in boxed), [line for line in boxed if line[-1] not in BORDERS]  # not cropped
    assert not [line for line in boxed if "┃┃" in line or "││" in line or "┳┳" in line]  # no empty column
    differs = {tokens_state(p) for p in compare(a, b, show_all=True).pairs}
    pair_rows = [line for line in boxed if re.match(r"│\s+\d+ │", line)]
    assert len(pair_rows) == (10 if width >= 60 else 0)
    for line in pair_rows:  # the seed shows, and a cut cell ends after a whole word of what differs
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[1] == "3"
        if cells[-1].endswith("…"):
            kept = cells[-1][:-1]
            assert any(full.startswith(kept) and full[len(kept)] in " ,:;" for full in differs), cells[-1]
        else:
            assert cells[-1] in differs
    if width < 60:  # too narrow for the table: one line per pair, still within the width
        assert len([line for line in lines if re.match(r"\d+ seed 3: A ", line)]) == 10


def test_fit_words_cuts_after_a_whole_word():
    assert fit_words("tokens differ at 20 positions: 15, 29, 30", 80) == "tokens differ at 20 positions: 15, 29, 30"
    assert fit_words("tokens differ at 20 positions: 15, 29, 30", 24) == "tokens differ at 20…"
    assert fit_words("tokens differ at 20 positions: 15, 29, 30", 37) == "tokens differ at 20 positions: 15…"
    assert fit_words("abcdefghij", 5) == "abcd…"  # one long word: cut where it must be
    assert all(len(fit_words("a bb ccc dddd eeeee", w)) <= w for w in range(1, 25))


def test_success_is_one_notation_in_every_view(two_runs, capsys, tmp_path):
    """The two-run table wrote 67% where the rollout summary, the single-run view and train wrote 0.667."""
    from agent_loop.cli.tables import summary_table
    from agent_loop.inspect.runs import stats
    from agent_loop.runners.stats import RolloutStats

    a, b, before, after = two_runs
    want = {path: rate(sum(bool(t.info["success"]) for t in run) / len(run)) for path, run in ((a, before), (b, after))}
    assert all(re.fullmatch(r"[01]\.\d{3}", value) for value in want.values())
    assert main([str(a), str(b), "--width", "80"]) == 0
    two = capsys.readouterr().out
    assert re.search(rf"│ success rate\s+│\s+{re.escape(want[a])} │\s+{re.escape(want[b])} │", two)
    assert main([str(a), "--width", "100"]) == 0
    one = capsys.readouterr().out
    assert re.search(rf"success rate\s+│?\s*{re.escape(want[a])} \(\d+ of 10\)", one)
    page = tmp_path / "page.html"
    assert main([str(a), "--html", str(page), "--quiet"]) == 0
    assert f"<td>{want[a]}</td>" in page.read_text()
    summary = RolloutStats()
    for t in before:
        summary.add(t)
    assert stats(summary)["success rate"] == want[a]
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(summary_table(summary, "arithmetic rollout"))
    assert want[a] in console.export_text()
    for text in (two, one, page.read_text(), console.export_text()):
        assert not re.search(r"success[^\n]*\d%", text)  # no percentage beside a success anywhere
