"""The PNG's layout (issue 40 item 12): the legend never covers the title, the title's end is inside the figure,
and no panel is spent on a flat failure (every return and reward 0) while an episode with values is shown.
Episodes from the real runner (tests/helpers/inspect_runs.py: the real Qwen2.5 tokenizer and chat template)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from agent_loop.inspect import plots
from agent_loop.inspect.view import Selection, build_view, scan


@pytest.fixture(scope="module")
def played(qwen_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.helpers.inspect_runs import write_run

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)
    folder = tmp_path_factory.mktemp("a_rather_long_folder_name_for_the_rollouts_of_this_run_" * 2)
    path = folder / "before.jsonl"
    trajectories = write_run(tokenizer, path, "before", 12)
    assert any(t.reward == 0 for t in trajectories) and any(t.reward > 0 for t in trajectories)
    return path


@pytest.mark.parametrize("selection", [Selection("informative", 3), Selection("all", 100)])
def test_the_legend_leaves_the_title_whole_and_flat_failures_get_no_panel(played, selection):
    view = build_view(scan(played, selection, compare=False))
    flat = [r for r in view.selected if plots.flat(view, r)]
    assert flat, "the selection holds a flat failure"  # (the informative one: the lowest-reward failure)
    fig = plots.figure(view)
    try:
        rows = plots.panel_rows(view)
        assert rows == [r for r in view.selected if not plots.flat(view, r)][:plots.MAX_EPISODE_PLOTS]
        assert len([a for a in fig.axes if a.get_lines()]) == len(rows)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        title = fig._suptitle.get_window_extent(renderer)
        [legend] = fig.legends
        box = legend.get_window_extent(renderer)
        assert not title.overlaps(box), (title, box)
        assert title.x0 >= 0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1  # its end is on the figure
        for ax in fig.axes:  # nor does the legend cover a panel
            assert not ax.get_window_extent(renderer).overlaps(box)
        assert f"{len(flat)} of them with all values 0" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_only_flat_failures_still_draw_one_panel(played):
    view = build_view(scan(played, Selection("all", 100, failed=True), compare=False))
    flat = [r for r in view.selected if plots.flat(view, r)]
    if len(flat) != len(view.selected):  # keep only the flat failures
        view.selected = flat
    assert plots.panel_rows(view) == flat[:1]
