"""Nothing lost at the command line (issue 30): one output per run, ``--resume`` that refuses
other settings, prompts in an unknown format, SIGINT/SIGTERM and a full disk as one line and a command
that goes on. The signal and file-limit tests run the real CLI in a subprocess on the tiny agent."""

import dataclasses
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from agent_loop.cli import main
from agent_loop.runners.outputs import FOLDER_LOCK

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def from_a_terminal():
    """Ctrl-C reaches the command (SIGINT's default action), also when this suite itself runs as a background
    job, whose children start with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def as_a_background_job():
    """``agent-loop ... &`` from a script, or nohup under a scheduler: SIGINT ignored from the start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def one_error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def test_train_into_an_earlier_run_is_refused_unless_resume_or_overwrite(tmp_path, capsys):
    """The probe: train --output-dir R twice: the second run rewrote the first's metrics and config silently."""
    run = tmp_path / "R"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert main(["train", "--steps", "1", "--output-dir", str(run)]) == 2
    line = one_error_line(capsys, "agent-loop train")
    assert "holds an earlier run (checkpoints, metrics.jsonl)" in line and f"--resume {run}" in line
    assert "--overwrite" in line
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n' and not (run / FOLDER_LOCK).exists()
    assert main(["train", "--resume", str(run), "--overwrite"]) == 2
    assert "exclude each other" in one_error_line(capsys, "agent-loop train")


def test_train_picks_a_fresh_default_folder_and_resumes_into_the_run_it_continues(tmp_path, monkeypatch):
    from agent_loop.cli.flags import validate
    from agent_loop.recipes.train_options import TrainConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert validate(TrainConfig, {}).output.output_dir == "runs/train"
    (tmp_path / "runs" / "train").mkdir(parents=True)
    assert validate(TrainConfig, {}).output.output_dir == "runs/train-2"
    assert validate(TrainConfig, {"resume": "old/checkpoints/step_000004"}).output.output_dir == "old"
    assert validate(TrainConfig, {"resume": "old"}).output.output_dir == "old"


def test_a_second_train_into_a_locked_folder_is_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "R"
    script = textwrap.dedent(f"""
        import time
        from agent_loop.runners.outputs import RunLock
        RunLock({str(run)!r}, folder=True).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", "--output-dir", str(run)]) == 2
        line = one_error_line(capsys, "agent-loop train")
        assert f"is in use by another run: pid {holder.pid} on " in line
    finally:
        holder.kill()
        holder.wait(10)


def test_prompts_in_an_unknown_format_is_one_line_naming_the_formats(tmp_path, capsys):
    for name in ("prompts.csv", "prompts.txt"):
        path = tmp_path / name
        path.write_text("prompt,answer\nWhat is 1+1?,2\n")
        assert main(["rollout", "--prompts", str(path), "--reward", "exact", "--out", str(tmp_path / "o.jsonl")]) == 2
        line = one_error_line(capsys, "agent-loop rollout")
        assert f"unknown prompts format {path.suffix}" in line and ".jsonl" in line and ".parquet" in line
        assert "save_to_disk" in line


@pytest.fixture
def model_folder(qwen_dir, tmp_path) -> Path:
    """A model folder that passes the checks (the real Qwen tokenizer, a Qwen2 config) without weights:
    enough for commands refused before anything loads."""
    folder = tmp_path / "model"
    shutil.copytree(qwen_dir, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"")  # never loaded: every command here stops before
    return folder


def test_rollout_resume_with_other_episode_settings_is_refused_unless_allowed(model_folder, tmp_path, capsys):
    """The probe: --resume with --temperature 0 --max-turns 1 after 1 and 4 was accepted, the file mixed."""
    from agent_loop.cli.rollout import RolloutOptions

    out = tmp_path / "run.jsonl"
    first = RolloutOptions(model=str(model_folder), out=str(out), episodes=2, temperature=1.0, max_turns=4)
    saved = out.with_name("run.config.yaml")
    saved.write_text(yaml.safe_dump(dataclasses.asdict(first)))
    out.write_text("".join(json.dumps({"info": {"index": i, "seed": 0, "task": "arithmetic"}}) + "\n" for i in range(2)))
    base = ["rollout", "--model", str(model_folder), "--out", str(out), "--episodes", "2", "--resume"]
    assert main(base + ["--temperature", "0", "--max-turns", "1"]) == 2
    line = one_error_line(capsys, "agent-loop rollout")
    assert "max_turns: 4 -> 1; temperature: 1.0 -> 0.0" in line and "--allow-config-change" in line
    assert main(base + ["--concurrency", "3"]) == 0  # how fast is not what an episode is
    assert "nothing to play" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="temperature: 1.0 -> 0.0"):
        assert main(base + ["--temperature", "0", "--allow-config-change"]) == 0
    assert yaml.safe_load(saved.read_text())["temperature"] == 1.0  # the first run's settings are kept


# -- real processes: signals, two runs at once, a file size limit ----------------------------------------

HANGING_SERVER = textwrap.dedent("""
    import asyncio, sys
    from aiohttp import web
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": sys.argv[1], "object": "model"}]})
    async def hang(request):  # a completion that never answers: the run is mid-episode when stopped
        await asyncio.sleep(3600)
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", hang)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=lambda *a: print("up", flush=True))
""")


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_episode_stops_a_rollout_in_one_line_and_releases_its_output(model_folder, tmp_path, stop):
    """The probe: SIGINT printed a 52-line traceback. A real OpenAI-compatible server on 127.0.0.1 whose
    completions never answer; the real CLI in a subprocess; the real signal."""
    from agent_loop.backends.vllm_server import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", HANGING_SERVER, str(model_folder), str(port)], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    out = tmp_path / "run.jsonl"
    try:
        assert server.stdout.readline().strip() == "up"
        command = [sys.executable, "-m", "agent_loop.cli", "rollout", "--model", str(model_folder), "--backend", "http",
                   "--server", f"http://127.0.0.1:{port}", "--episodes", "5", "--out", str(out)]
        process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=from_a_terminal)
        deadline = time.monotonic() + 120
        while not out.with_name("run.config.yaml").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the settings are saved just before the episodes start
        # the probe: two runs into one --out both wrote every episode (this one's episodes never finish)
        second = subprocess.run(command + ["--resume"], env=ENV, capture_output=True, text=True, timeout=120)
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert second.returncode == 2 and f"in use by another run: pid {process.pid} on " in second.stderr, second.stderr
        process.send_signal(stop)
        stderr = process.communicate(timeout=60)[1]
    finally:
        server.kill()
        server.wait(10)
    assert process.returncode == 128 + stop, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("agent-loop rollout")]
    assert len(ours) == 1 and ours[0].startswith(f"agent-loop rollout: stopped by {stop.name}; {out} holds 0 whole "
                                                 "episodes"), stderr[-3000:]
    assert ours[0].endswith(f"--out {out} --resume")
    assert not out.with_name("run.jsonl.lock").exists()


# the tiny agent's runs


def rollout_command(model: Path, out: Path, episodes: int = 400) -> list[str]:
    return [sys.executable, "-m", "agent_loop.cli", "rollout", "--model", str(model), "--backend", "hf",
            "--episodes", str(episodes), "--concurrency", "2", "--seed", "3", "--out", str(out)]


def wait_for_lines(path: Path, process: subprocess.Popen, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {count} lines in {path}: {process.poll()} {process.stderr.read()[-2000:] if process.poll() is not None else ''}")


def go_on_line(stderr: str) -> list[str]:
    """The command the one-line message says goes on (after ':' ), as argv."""
    import shlex

    command = stderr.strip().splitlines()[-1].rsplit(": agent-loop ", 1)[1]
    return [sys.executable, "-m", "agent_loop.cli", *shlex.split(command)]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stop, started", [(signal.SIGINT, from_a_terminal), (signal.SIGTERM, from_a_terminal),
                                           (signal.SIGTERM, as_a_background_job)], ids=["SIGINT", "SIGTERM", "SIGTERM-bg"])
def test_a_stopped_rollout_says_what_is_written_in_one_line_and_its_command_finishes_the_run(
        tiny_agent_dir, tmp_path, stop, started):
    """SIGTERM to a background job (SIGINT ignored): the CLI raised a KeyboardInterrupt inside whichever
    task ran, and asyncio printed that task's traceback ("Task exception was never retrieved")."""
    out = tmp_path / "run.jsonl"
    process = subprocess.Popen(rollout_command(tiny_agent_dir, out, 60), env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=started)
    wait_for_lines(out, process, 4)
    process.send_signal(stop)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 128 + stop, stderr[-3000:]
    lines = [line for line in stderr.strip().splitlines() if line.startswith("agent-loop rollout")]
    assert "Traceback" not in stderr and len(lines) == 1, stderr[-3000:]
    assert f"stopped by {stop.name}; {out} holds " in lines[0] and "--resume" in lines[0]
    assert not out.with_name("run.jsonl.lock").exists()
    done = subprocess.run(go_on_line(stderr), env=ENV, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    indices = [json.loads(line)["info"]["index"] for line in out.read_text().splitlines()]
    assert sorted(indices) == list(range(60))  # every episode exactly once


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_rollout_past_the_file_size_limit_is_one_line_and_its_command_finishes_the_run(tiny_agent_dir, tmp_path):
    """The probe: a failing write printed a 25-line traceback, left a torn last line, gave no resume hint."""
    out = tmp_path / "run.jsonl"
    done = subprocess.run(rollout_command(tiny_agent_dir, out, 40), env=ENV, capture_output=True, text=True,
                          timeout=500, preexec_fn=_limit_file_size)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert f"cannot write {out}: File too large" in message and "--resume" in message, done.stderr[-3000:]
    data = out.read_bytes()
    assert data.endswith(b"\n") and len(data) <= 60_000  # whole lines only
    finished = subprocess.run(go_on_line(done.stderr), env=ENV, capture_output=True, text=True, timeout=500)
    assert finished.returncode == 0, finished.stderr[-3000:]
    indices = [json.loads(line)["info"]["index"] for line in out.read_text().splitlines()]
    assert sorted(indices) == list(range(40))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_stopped_train_is_one_line_naming_its_checkpoints_and_the_resume_command(tmp_path):
    run = tmp_path / "R"
    command = [sys.executable, "-m", "agent_loop.cli", "train", "--steps", "40", "--prompts-per-step", "4",
               "--mini-batches", "1", "--save-every", "1", "--output-dir", str(run), "--no-progress",
               "--no-tensorboard", "--threads", "1"]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=from_a_terminal)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and process.poll() is None and not list((run / "checkpoints").glob("step_*")):
        time.sleep(0.2)
    assert process.poll() is None, process.stderr.read()[-3000:]
    process.send_signal(signal.SIGINT)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("agent-loop train: stopped by SIGINT; checkpoints up to step_") and f"--resume {run}" in last
    assert not (run / FOLDER_LOCK).exists()


# -- --append compares settings as --resume does; a reward that raises, counted everywhere -------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollout_append_with_other_episode_settings_is_refused_unless_allowed(tiny_agent_dir, tmp_path, capsys):
    """--append compared no settings: episodes of another temperature went into the same file silently."""
    out = tmp_path / "run.jsonl"
    settings = ["rollout", "--model", str(tiny_agent_dir), "--out", str(out), "--episodes", "1", "--max-turns", "1",
                "--max-tokens", "8"]
    assert main(settings) == 0
    saved = out.with_name("run.config.yaml")
    first = out.read_text()
    assert len(first.splitlines()) == 1 and yaml.safe_load(saved.read_text())["temperature"] == 1.0
    capsys.readouterr()
    assert main(settings + ["--append", "--temperature", "0", "--max-turns", "2"]) == 2
    line = one_error_line(capsys, "agent-loop rollout")
    assert line.startswith("agent-loop rollout: error: --append: settings differ from those the episodes in ")
    assert "max_turns: 1 -> 2; temperature: 1.0 -> 0.0" in line and "--allow-config-change" in line
    assert out.read_text() == first and not out.with_name("run.jsonl.lock").exists()  # nothing added
    assert main(settings + ["--append", "--concurrency", "2"]) == 0  # how fast is not what an episode is
    assert len(out.read_text().splitlines()) == 2
    with pytest.warns(UserWarning, match=r"--append with changed settings .*temperature: 1.0 -> 0.0"):
        assert main(settings + ["--append", "--temperature", "0", "--allow-config-change"]) == 0
    assert len(out.read_text().splitlines()) == 3 and yaml.safe_load(saved.read_text())["temperature"] == 1.0
    empty = tmp_path / "empty.jsonl"  # an empty file holds no episodes to mix with: nothing to compare
    empty.write_text("")
    assert main(settings[:4] + [str(empty)] + settings[5:] + ["--append", "--temperature", "0"]) == 0
    assert len(empty.read_text().splitlines()) == 1


FLAKY_REWARD = textwrap.dedent("""
    def flaky(completion, row):
        if row["bad"]:
            raise ValueError(f"no reward for question {row['q']}")
        return 1.0 if completion else 0.0
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_reward_function_that_raises_is_an_error_counted_by_rollout_inspect_and_train(tiny_agent_dir, tmp_path,
                                                                                         capsys):
    """--reward module:function raising for some rows: each such episode ends with finish "error" (not reward 0);
    the rollout's summary, inspect and the trainer's metrics.jsonl count them, and training drops them."""
    prompts = tmp_path / "prompts.jsonl"
    bad = {1, 3}  # questions 1 and 3 of 8
    prompts.write_text("".join(json.dumps({"prompt": f"What is {q}+{q}?", "answer": 2 * q, "q": q, "bad": q in bad})
                               + "\n" for q in range(8)))
    (tmp_path / "flaky_reward.py").write_text(FLAKY_REWARD)
    task = ["--prompts", str(prompts), "--reward", f"{tmp_path / 'flaky_reward.py'}:flaky"]
    common = ["--model", str(tiny_agent_dir), *task, "--max-turns", "2", "--max-tokens", "24"]
    out = tmp_path / "run.jsonl"
    assert main(["rollout", *common, "--episodes", "8", "--out", str(out), "--max-error-fraction", "0.5"]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # as one line: rich wraps at the terminal's width
    assert "2 of 8 episodes ended with an error (2 in scoring: the reward failed or hung); the first:" in printed
    assert "episode 1: RewardError: reward function 'flaky' raised ValueError: no reward for question 1" in printed
    assert re.search(r"finish reasons .*error 2", printed), printed
    records = {json.loads(line)["info"]["index"]: json.loads(line) for line in out.read_text().splitlines()}
    assert sorted(i for i, r in records.items() if r["finish_reason"] == "error") == sorted(bad)
    assert all(records[i]["reward"] == 0.0 and "no reward for question" in records[i]["info"]["reward_error"]
               and records[i]["response_ids"] for i in bad)  # its tokens are kept
    assert all(r["reward"] in (0.0, 1.0) and "reward_error" not in r["info"] for i, r in records.items() if i not in bad)
    # the default --max-error-fraction (0.1): 2 of 8 failed is exit status 1
    assert main(["rollout", *common, "--episodes", "8", "--out", str(tmp_path / "strict.jsonl")]) == 1
    capsys.readouterr()

    assert main(["inspect", str(out), "--width", "200"]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"reward errors\s*│?\s*2\b", shown), shown
    assert "reward errors: 2 episodes" in shown and "episode 1: RewardError: reward function 'flaky'" in shown

    run = tmp_path / "train"
    with pytest.warns(UserWarning, match="first reward error"):
        assert main(["train", *common, "--steps", "1", "--prompts-per-step", "4", "--group-size", "2",
                     "--mini-batches", "1", "--threads", "1", "--output-dir", str(run), "--no-tensorboard",
                     "--no-progress"]) == 0
    [step] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # step 1 plays questions 0-3, two samples each: questions 1 and 3 fail in both samples
    assert step["errors/reward"] == 4.0 and step["episodes/dropped_failed"] == 4.0
    assert step["finish_frac/error"] == 0.5 and step["skipped_steps"] == 0.0
