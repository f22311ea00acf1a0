"""`agent-loop rollout --context window` (issue 54 items 3 and 4): the command's summary and closing line count
sessions, with the segments (the records written) beside them, and the file holds every segment."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from agent_loop.cli import main

pytestmark = pytest.mark.slow


def test_a_windowed_rollout_counts_sessions_and_writes_their_segments(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    main(["rollout", "--task", "lookup", "--context", "window", "--context-window", "1", "--episodes", "4",
          "--no-progress", "--out", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    records = [json.loads(line) for line in out.read_text().splitlines()]
    per_session = Counter(r["info"]["session_id"] for r in records)
    assert len(per_session) == 4 and len(records) > 4  # some episode outgrew its window: several segments
    assert f"│ episodes │ 4 ({len(records)} segments) │" in printed  # the summary table's row
    assert f"wrote {len(records)} trajectories (4 episodes) to {out}" in printed
    for session, n in per_session.items():
        segments = sorted(r["info"]["segment"] for r in records if r["info"]["session_id"] == session)
        assert segments == list(range(n))
