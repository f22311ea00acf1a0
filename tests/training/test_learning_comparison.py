"""examples/learning_comparison.py on the tiny agent: two settings, their held-out success and rollout tokens, a
cell that goes on from its checkpoint, and finished cells left alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from agent_loop.runners.local import read_trajectories

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "learning_comparison.py"


def load_example():
    """The example as a module of its own (examples/ is not a package the tests import)."""
    spec = importlib.util.spec_from_file_location("learning_comparison", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

COMMON = ["--model", "tiny", "--task", "arithmetic", "--estimator", "grpo", "--group-size", "2", "--prompts-per-step",
          "2", "--mini-batches", "1", "--threads", "1", "--no-tensorboard", "--save-every", "1", "--max-turns", "2"]


def serial_tokens(folder) -> float:
    """Every step's assistant and observation tokens per episode times the episodes it played, summed plainly."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    total = 0.0
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        step = json.loads(line)
        if "assistant_tokens" in step:
            episodes = step.get("filter_groups/examined", config["prompts_per_step"]) * config["group_size"]
            total += step["assistant_tokens"] * episodes + step["observation_tokens"] * episodes
    return total


def metrics_of(out, name):
    """A cell's step metrics (not its evaluations)."""
    lines = (out / name / "seed-0" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "assistant_tokens" in m]


@pytest.mark.slow
def test_two_settings_are_compared_and_a_cut_cell_goes_on(tmp_path):
    out = tmp_path / "cmp"
    argv = ["--out", str(out), "--variant", "none=", "--variant", "filter=--filter-groups --filter-groups-max-rounds 1",
            "--seeds", "0", "--eval-episodes", "4", "--start", "--"]
    main = load_example().main
    results = main([*argv, *COMMON, "--steps", "1"])
    assert set(results) == {"start", "none", "filter"}
    start = read_trajectories(out / "start" / "seed-0" / "held_out.jsonl")  # the untrained model, the same questions
    assert [t.info["seed"] for t in start] == [1_000_003] * 4 and start[0].info["model_path"].endswith("final")
    assert results["start"]["0"] == {"held_out_success": sum(t.success for t in start) / 4, "rollout_tokens": 0.0,
                                     "steps": 0}
    for name, cells in results.items():
        if name == "start":
            continue
        folder = out / name / "seed-0"
        held_out = read_trajectories(folder / "held_out.jsonl")
        assert len(held_out) == 4 and {t.info["seed"] for t in held_out} == {1_000_003}  # train's eval stream
        assert yaml.safe_load((folder / "held_out.config.yaml").read_text())["rollout_dtype"] == "fp32"  # every cell alike
        assert cells["0"] == {"held_out_success": sum(t.success for t in held_out) / 4,
                              "rollout_tokens": serial_tokens(folder), "steps": 1}
        assert cells["0"]["rollout_tokens"] > 0
    report = (out / "results.md").read_text()
    assert "| filter | 1 |" in report and "| start | 1 |" in report
    none, filtered = metrics_of(out, "none"), metrics_of(out, "filter")  # the curve: each step's training success
    assert [m["step"] for m in none] == [m["step"] for m in filtered] == [1]
    assert f"| 1 | {none[0]['success']:.3f} | {filtered[0]['success']:.3f} |" in report
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    # a finished cell is not run again; one whose result is gone goes on from its checkpoint to the new length
    del results["none"]["0"]
    (out / "results.json").write_text(json.dumps(results))
    again = main([*argv, *COMMON, "--steps", "2"])
    assert again["none"]["0"]["steps"] == 2 and again["filter"] == results["filter"]
    assert (out / "none" / "seed-0" / "checkpoints" / "step_000002").is_dir()


def test_held_out_success_counts_a_session_of_several_segments_once(tmp_path):
    """A session rewritten into segments is several records, each with the session's success: counted once."""
    session_success = load_example().session_success
    record = {"prompt_ids": [1], "response_ids": [2], "spans": [1], "turn_ids": [0], "logprobs": [0.0],
              "messages": [], "reward": 1.0}
    rows = [{**record, "info": {"session_id": "a", "segment": k, "success": True}} for k in range(3)]
    rows.append({**record, "reward": 0.0, "info": {"session_id": "b", "segment": 0, "success": False}})
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(read_trajectories(path)) == 4 and session_success(path) == 0.5  # per record it would read 0.75


def test_steps_and_tokens_to_a_level_are_the_first_step_reaching_it_and_the_tokens_up_to_it(tmp_path):
    """Per step: (assistant + observation tokens) x groups examined x group size, summed up to the first step whose
    training success reaches the level; a level no step reached is '-'."""
    example = load_example()
    steps = [{"step": 1, "success": 0.25, "assistant_tokens": 10.0, "observation_tokens": 2.0},
             {"step": 2, "success": 0.75, "assistant_tokens": 8.0, "observation_tokens": 1.0,
              "filter_groups/examined": 5},
             {"step": 3, "success": 0.5, "assistant_tokens": 6.0, "observation_tokens": 0.0}]
    for name in ("a", "b"):
        folder = tmp_path / name / "seed-0"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"prompts_per_step": 2, "group_size": 4}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps + [{"eval/success": 1.0}]))
    folder = tmp_path / "a" / "seed-0"
    assert example.reached(folder, 0.5) == (2, 12.0 * 2 * 4 + 9.0 * 5 * 4)
    assert example.reached(folder, 0.25) == (1, 96.0) and example.reached(folder, 0.9) is None
    assert example.rollout_tokens(folder) == serial_tokens(folder)
    results = {"start": {"0": {}}, "a": {"0": {}}, "b": {"0": {}}}
    report = example.to_levels(tmp_path, results, [0.5, 0.9])
    assert "| a | 0.5 | 1 of 1 | 2.0 | 276 |" in report and "| b | 0.9 | 0 of 1 | - | - |" in report
    assert "| start |" not in report
