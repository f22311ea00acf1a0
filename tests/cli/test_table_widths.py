"""No table of ours breaks a name at 80 or 60 columns (issue 56 item 5: `agent-loop models` printed
``smollm2-13`` / ``5m``): names, commands and paths stay whole; free text wraps at words or is cut with ``…``.

Each table is read back from what the real command printed at 80 and 60 columns and compared with the same
table printed 400 columns wide, where nothing wraps (the reference kept here: cells joined over their lines)."""

from __future__ import annotations

import json
import re

import pytest

from agent_loop.builtin_models import builtin_names, listing
from agent_loop.cli import main
from agent_loop.tiny.build import build_record

WIDTHS = (80, 60)
WIDE = 400


def printed(capsys, monkeypatch, width: int, argv: list[str]) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(argv) == 0
    out = capsys.readouterr().out
    table_lines = [line for line in out.splitlines() if "│" in line or "─" in line]  # rows, rules
    assert table_lines and all(len(line) <= width for line in table_lines)
    return out


def boxed_rows(text: str, title: str, key: int) -> list[list[str]]:
    """The rows of the boxed table under ``title``, each cell's lines joined by a space; a row begins on a line
    whose cell ``key`` is not empty (that column's cells start on their row's first line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if title in line)
    rows = []
    for line in lines[start:]:
        if line.startswith("└"):
            break
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[key] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
    assert rows, text
    return rows


def cut_at_words(narrow: str, wide: str) -> bool:
    """``narrow`` is ``wide`` wrapped at words, some words cut with … (never split over two lines)."""
    words = wide.split()
    for word in narrow.split():
        if word.endswith("…"):
            position = next((i for i, w in enumerate(words) if w.startswith(word[:-1])), None)
        else:
            position = words.index(word) if word in words else None
        if position is None:
            return False
        words = words[position + 1:]
    return True


def test_the_cell_reader_sees_a_broken_name():
    """The check itself: the old models table (overflow fold) split the name over two lines."""
    broken = "x\n│ smollm2-13 │ 134.5M │\n│ 5m         │        │\n└"
    assert [row[0] for row in boxed_rows(broken, "x", key=0)] == ["smollm2-13", "5m"]  # not builtin_names()
    assert boxed_rows(broken, "x", key=1) == [["smollm2-13 5m", "134.5M"]]  # joined: still not the name
    assert not cut_at_words("smollm2-13 5m", "smollm2-135m") and cut_at_words("SmolLM2… (Hugging", "SmolLM2-135M (Hugging")


@pytest.mark.parametrize("width", WIDTHS)
def test_models_keeps_names_whole(width, capsys, monkeypatch):
    wide = boxed_rows(printed(capsys, monkeypatch, WIDE, ["models"]), "built-in models", key=0)
    out = printed(capsys, monkeypatch, width, ["models"])
    narrow = boxed_rows(out, "built-in models", key=0)
    assert [row[0] for row in narrow] == [row[0] for row in wide] == builtin_names()
    for short, full in zip(narrow, wide):
        assert short[1:3] == full[1:3]  # parameters and status whole
        assert all(cut_at_words(a, b) for a, b in zip(short[3:], full[3:])), (short, full)
    for row in listing():  # each folder and digest on a line of its own, whole
        assert f"{row['name']}: {row['folder']} (sha256 {row['sha256']})" in out.splitlines()


@pytest.mark.parametrize("width", WIDTHS)
def test_tiny_keeps_stage_task_and_rates_whole(width, capsys, monkeypatch):
    record = build_record()
    out = printed(capsys, monkeypatch, width, ["tiny"])
    lines = out.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if set(line.strip()) == {"─"}) + 1:]
    rows = [line.split() for line in body if line.strip()][:sum(len(s["eval"]) for s in record["stages"].values())]
    expected = [[stage, row["task"], "greedy" if row["greedy"] else "T=1.0", str(row["episodes"]),
                 f"{row['well_formed']:.3f}", f"{row['right_arguments']:.3f}", f"{row['success']:.3f}"]
                for stage, info in record["stages"].items() for row in info["eval"]]
    assert rows == expected


@pytest.mark.slow
def test_rollout_tables_keep_their_labels_and_values_whole(tmp_path, capsys, monkeypatch):
    """The run's summary and its batch's returns table, printed by the real command (tiny agent): every label
    and value reads the same at 80 and 60 columns as at 400."""
    tables = ("arithmetic rollout", "batch tensors and")
    outputs = {}
    for width in (WIDE, *WIDTHS):
        out = tmp_path / f"{width}.jsonl"
        outputs[width] = printed(capsys, monkeypatch, width, ["rollout", "--episodes", "4", "--concurrency", "2",
                                                              "--out", str(out), "--no-progress"])
        assert len(out.read_text().splitlines()) == 4
    for title in tables:
        wide = boxed_rows(outputs[WIDE], title, key=1)
        assert len(wide) >= 7 and all(len(row) == 2 for row in wide)
        for width in WIDTHS:
            assert boxed_rows(outputs[width], title, key=1) == wide, (title, width, outputs[width])
    assert json.loads((tmp_path / "60.jsonl").read_text().splitlines()[0])["spans"]
    assert re.search(r"assistant tokens/s\s+warm", outputs[60])
