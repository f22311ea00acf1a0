"""``agent-loop warmstart``: bad input is one line on stderr with exit status 2, before any model is loaded (a task
without demonstrations, a demonstration that fails, a taken output folder, bad values); a good run saves a
model folder that ``agent-loop rollout --model`` and ``agent-loop train --model`` load."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from agent_loop.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = f"{REPO / 'examples' / 'custom_task.py'}:Reverse"
PREFIX = "agent-loop warmstart: error: "


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit status, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    return lines[0].removeprefix(PREFIX)


TASK_FILE = textwrap.dedent('''
    from agent_loop import Environment


    def double(number: int) -> str:
        """Double a number.

        Args:
            number: The number to double.
        """
        return str(2 * number)


    class Twice(Environment):
        tools = [double]

        def sample(self, rng):
            n = rng.randint(1, 9)
            return {"prompt": f"What is twice {n}?", "answer": str(2 * n), "n": n}

        def score(self, completion, answer):
            return float(completion == f"The answer is {answer}.")


    class Wrong(Twice):
        def demonstrate(self, episode, rng):
            return [{"role": "assistant", "content": "The answer is 0."}]
''')


@pytest.fixture
def task_file(tmp_path) -> Path:
    path = tmp_path / "twice.py"
    path.write_text(TASK_FILE)
    return path


def test_a_task_without_demonstrations_is_refused_in_one_line(capsys, tmp_path, task_file):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "warmstart", "--task", f"{task_file}:Twice", "--output-dir", str(out))
    assert code == 2 and one_line(err) == (
        f"--task {task_file}:Twice: task 'Twice' has no demonstrations to warm-start on; give it a "
        "demonstrate(episode, rng) method returning a solved episode's messages (examples/custom_task.py)")
    assert not out.exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+2?", "answer": 4}) + "\n")
    code, _, err = run_cli(capsys, "warmstart", "--prompts", str(prompts), "--reward", "number", "--output-dir", str(out))
    assert code == 2 and one_line(err) == (
        f"--prompts {prompts}: task 'p' has no demonstrations to warm-start on; give its rows a 'demonstration' "
        "column (a solved episode's messages), or write the task as a class with a demonstrate(episode, rng) method "
        "and pass it with --task (examples/custom_task.py)")
    assert not out.exists()


def test_a_demonstration_that_fails_is_refused_naming_the_episode(capsys, tmp_path, task_file):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "warmstart", "--task", f"{task_file}:Wrong", "--episodes", "3", "--output-dir",
                           str(out), "--no-progress")
    assert code == 2
    assert one_line(err) == (
        f"--task {task_file}:Wrong: 3 of 3 demonstrations cannot be trained on; the first, episode 0: does not "
        f"succeed (reward 0; final answer 'The answer is 0.') (all are in {out / 'demonstrations.jsonl'}: agent-loop "
        "inspect shows them)")
    assert not (out / "model").exists() and len((out / "demonstrations.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
    (["--lr", "-1"], "--lr -1: must be a number > 0"),
    (["--batch-size", "1.5"], "--batch-size 1.5: must be an integer >= 1"),
    (["--device", "tpu"], "--device tpu: must be auto, cpu, cuda or cuda:N"),
    (["--gamma", "0.9"], "unrecognized arguments: --gamma 0.9"),
    (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),
    (["--tools", "t.py"], "--tools apply to a task from --prompts FILE; a --task brings its own tools and reward"),
])
def test_bad_values_are_one_line_before_anything_loads(capsys, tmp_path, argv, message):
    code, _, err = run_cli(capsys, "warmstart", "--task", EXAMPLE, "--output-dir", str(tmp_path / "out"), *argv)
    *usage, line = err.strip().splitlines()  # argparse puts its usage (wrapped as the command list grows) first
    assert code == 2 and message in line and all(u.startswith(("usage:", " ")) for u in usage), err
    assert not (tmp_path / "out").exists()


def test_an_output_folder_holding_files_is_refused_without_overwrite(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "warmstart", "--task", EXAMPLE, "--output-dir", str(out))
    assert code == 2 and one_line(err) == (f"--output-dir {out}: holds files (notes.txt); pass --overwrite to replace "
                                           "them, or another --output-dir")
    assert (out / "notes.txt").read_text() == "mine" and not (out / ".agent-loop.lock").exists()


def test_warm_start_then_rollout_and_train_load_the_model(capsys, tmp_path, tiny_agent_dir):
    out = tmp_path / "warm"
    (out / "old").mkdir(parents=True)
    code, stdout, err = run_cli(capsys, "warmstart", "--task", EXAMPLE, "--episodes", "8", "--steps", "2",
                                "--batch-size", "4", "--output-dir", str(out), "--overwrite", "--no-progress",
                                "--check-episodes", "3")
    assert code == 0, err
    # issue 49 item 2: whether the warm start took, on held-out questions, sampled, before the next commands
    check = next(line for line in stdout.splitlines() if line.startswith("held-out check"))
    assert check.startswith("held-out check (sampled at T=1, 3 episodes): success "), stdout
    assert stdout.index(check) < stdout.index("next: ") and len((out / "check.jsonl").read_text().splitlines()) == 3
    assert f"model: {out / 'model'}" in stdout and f"next: agent-loop rollout --task {EXAMPLE} --model {out / 'model'}" in stdout
    assert not (out / "old").exists() and not (out / ".agent-loop.lock").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["steps"] == 2 and saved["task"] == EXAMPLE and saved["output_dir"] == str(out)
    assert saved["lr"] == 3e-3  # the learning rate used: the tiny agent's default
    model = str(out / "model")
    code, stdout, err = run_cli(capsys, "rollout", "--task", EXAMPLE, "--model", model, "--episodes", "2",
                                "--max-turns", "2", "--out", str(tmp_path / "r.jsonl"))
    assert code in (0, 1), err  # 1: every episode failed, which a 2-step warm start may well do
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
    code, stdout, err = run_cli(capsys, "train", "--task", EXAMPLE, "--model", model, "--steps", "1",
                                "--prompts-per-step", "2", "--mini-batches", "1", "--concurrency", "2", "--no-progress",
                                "--no-tensorboard", "--output-dir", str(tmp_path / "train"))
    assert code == 0, err
    assert (tmp_path / "train" / "metrics.jsonl").read_text().strip()


def test_every_option_has_help_and_the_learning_rate_follows_the_model(capsys):
    import dataclasses

    from agent_loop.cli import build_parser
    from agent_loop.recipes.warmstart_options import MODEL_LR, TINY_LR, WarmstartConfig

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    actions = {a.dest: a for a in commands.choices["warmstart"]._actions if a.dest not in ("help", "config")}
    assert set(actions) == {f.name for f in dataclasses.fields(WarmstartConfig)}
    assert all(a.help and "default: " in a.help for a in actions.values())
    assert "gamma" not in actions and "concurrency" not in actions  # only the run options a warm start uses
    assert WarmstartConfig().learning_rate == TINY_LR and WarmstartConfig(model="m").learning_rate == MODEL_LR
    assert WarmstartConfig(model="m", lr=0.5).resolved()["lr"] == 0.5


TOOLS_FILE = textwrap.dedent('''
    def double(number: int) -> str:
        """Double a number.

        Args:
            number: The number to double.
        """
        return str(2 * number)
''')


def _demonstrated_rows(count: int) -> list[dict]:
    rows = []
    for n in range(1, count + 1):
        call = {"type": "function", "function": {"name": "double", "arguments": {"number": n}}}
        rows.append({"prompt": f"What is twice {n}?", "answer": str(2 * n), "demonstration": [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "double", "content": str(2 * n)},
            {"role": "assistant", "content": f"The answer is {2 * n}."}]})
    return rows


@pytest.mark.slow
def test_the_printed_next_commands_run_for_a_prompts_task(capsys, tmp_path, tiny_agent_dir):
    """Issue 40 item 7: the hint dropped --reward and --tools for a --prompts task, so running it failed with
    '--prompts needs a reward'. Each printed command is run as printed (plus limits that keep it short)."""
    import shlex

    prompts, tools = tmp_path / "twice.jsonl", tmp_path / "my tools.py"  # a space: the hint must quote it
    prompts.write_text("".join(json.dumps(row) + "\n" for row in _demonstrated_rows(4)))
    tools.write_text(TOOLS_FILE)
    out = tmp_path / "warm"
    code, stdout, err = run_cli(capsys, "warmstart", "--prompts", str(prompts), "--reward", "number", "--reward",
                                "contains", "--reward-weights", "1", "0.5", "--tools", str(tools), "--episodes", "4",
                                "--steps", "1", "--batch-size", "2", "--output-dir", str(out), "--no-progress")
    assert code == 0, err
    hints = [line.removeprefix("next:").strip() for line in stdout.splitlines()[-2:]]
    assert [h.split()[:2] for h in hints] == [["agent-loop", "rollout"], ["agent-loop", "train"]], stdout
    limits = {"rollout": ["--episodes", "2", "--max-turns", "2", "--out", str(tmp_path / "r.jsonl")],
              "train": ["--steps", "1", "--prompts-per-step", "1", "--group-size", "2", "--mini-batches", "1",
                        "--no-progress", "--no-tensorboard", "--output-dir", str(tmp_path / "train")]}
    for hint in hints:
        argv = shlex.split(hint, comments=True)[1:]  # as a shell runs it: the trailing '# why' is a comment
        assert argv[argv.index("--reward") + 1] == "number" and str(tools) in argv and "--reward-weights" in argv
        code, _, err = run_cli(capsys, *argv, *limits[argv[0]])
        assert code in (0, 1), err  # 1: a rollout whose every episode failed after a one-step warm start
        assert "error:" not in err, err
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "train" / "metrics.jsonl").read_text().strip()
