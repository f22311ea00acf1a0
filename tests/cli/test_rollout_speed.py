"""`agent-loop rollout` prints its warm generation speed (from the first request to the last episode's end) with
the start-up and stop times apart (issue 56 item 3): a slow start no longer lowers the tokens/s it prints.

The real command on the built-in tiny agent (transformers backend); its backend's start made 3 s slower by a
wrapper around the real factory. The printed rate is checked against the assistant tokens counted in the written
file (a plain serial count, kept here)."""

from __future__ import annotations

import json
import re
import time

import pytest

import agent_loop.cli.rollout as rollout
from agent_loop.cli import main

pytestmark = pytest.mark.slow
SLOW_START_S = 3.0
SPEED = re.compile(r"([\d.]+) episodes/s, (\d+) assistant tokens/s warm \(([\d.]+) s, first request to last "
                   r"episode's end\); start-up ([\d.]+) s, stop ([\d.]+) s \(not counted\)")


def assistant_tokens(path) -> int:
    """The ASSISTANT tokens (span kind 1) of every episode in a rollout file, counted one by one."""
    total = 0
    for line in path.read_text().splitlines():
        for kind in json.loads(line)["spans"]:
            total += kind == 1
    return total


def test_the_printed_speed_leaves_out_the_start_up(tmp_path, monkeypatch, capsys):
    real = rollout.make_backend

    def slow_start(*args, **kwargs):
        time.sleep(SLOW_START_S)  # as an engine that takes long to start
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout, "make_backend", slow_start)
    monkeypatch.setenv("COLUMNS", "400")  # the speed line on one line
    out = tmp_path / "run.jsonl"
    started = time.perf_counter()
    assert main(["rollout", "--episodes", "6", "--concurrency", "3", "--out", str(out), "--no-progress"]) == 0
    wall = time.perf_counter() - started
    printed = capsys.readouterr().out
    match = SPEED.search(printed)
    assert match, printed
    per_s, tokens_per_s, playing, start_up, stop = (float(g) for g in match.groups())
    tokens = assistant_tokens(out)
    assert tokens > 0
    assert start_up >= SLOW_START_S and playing > 0 and start_up + playing + stop <= wall + 0.15  # 3 figures at 0.1 s
    # warm: the file's tokens over the playing time only (the printed values are rounded)
    assert tokens / (playing + 0.05) - 1 <= tokens_per_s <= tokens / max(playing - 0.05, 1e-3) + 1
    assert 6 / (playing + 0.05) - 0.01 <= per_s <= 6 / max(playing - 0.05, 1e-3) + 0.01
    assert tokens_per_s > tokens / (start_up + playing)  # the old figure, start-up included, was lower
