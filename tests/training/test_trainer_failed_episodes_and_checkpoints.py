"""Issue 30, the trainer: failed episodes dropped (and counted) instead of stopping the run, a step with nothing
to train on skipped with a warning; checkpoints read without running code (``weights_only=True``), verified by
sha256 and refused when their weights are not finite; data-parallel workers that die with their launcher.

Real parts: the tiny agent's middling warm start, real rollouts through the agent loop, real checkpoints
written by the trainer, a real ``--nproc 2`` run under torchrun killed with SIGKILL.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from advantages import get_estimator
from agent_loop import TrainConfig, Trainer
from agent_loop.recipes.train import usable_episodes
from agent_loop.tasks.registry import get_task
from agent_loop.training.checkpoint import MANIFEST, STATE_FILE, CheckpointError, step_folder
from agent_loop.types import Trajectory
from masking import SpanKind
from tests.helpers.processes import alive

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def config_for(tiny_mid: str, out: Path, **overrides) -> TrainConfig:
    """8 episodes per step (4 questions x 2 samples), one mini-batch."""
    settings = dict(model=tiny_mid, steps=1, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=1,
                    micro_batch_size=4, ppo_epochs=1, threads=1, output_dir=str(out), progress=False,
                    entropy_coef=0.01)  # a gradient whatever the success rate
    settings.update(overrides)
    return TrainConfig.from_flat(**settings)


class FlakyReward:
    """The arithmetic task whose reward raises for the episodes ``failing(index)`` picks (as a user's reward
    function with a bug for some answers would)."""

    def __init__(self, failing):
        self.task, self.failing = get_task("arithmetic"), failing
        self.name = "flaky-arithmetic"

    def make_episode(self, index, seed=0):
        return self.task.make_episode(index, seed)

    def reward(self, episode, messages, tool_calls):
        if self.failing(episode.info["index"]):
            raise KeyError("a bug in the reward function")
        return self.task.reward(episode, messages, tool_calls)


# -- failed episodes ----------------------------------------------------------------------------------------


def record(index: int, reward: float, failed: bool = False) -> Trajectory:
    spans = [] if failed else [SpanKind.ASSISTANT, SpanKind.ASSISTANT]
    return Trajectory(prompt_ids=[1, 2], response_ids=[] if failed else [3, 4], spans=spans, turn_ids=[0] * len(spans),
                      logprobs=[0.0] * len(spans), messages=[], reward=reward, finish_reason="error" if failed else "stop",
                      metrics={}, info={"index": index} if failed else {"index": index, "group": index // 3})


def test_failed_episodes_are_dropped_and_a_member_left_alone_in_its_group_too():
    """Groups of 3: group 0 loses one member (two kept, their baseline over the two), group 1 loses two (the
    survivor has no baseline: dropped for a group estimator, kept for a per-row one), group 2 is whole."""
    rewards = [1.0, 0.0, 0.5, 0.2, 0.9, 0.4, 1.0, 0.3, 0.0]
    failed = {1, 3, 5}
    episodes = [record(i, r, i in failed) for i, r in enumerate(rewards)]
    kept, dropped = usable_episodes(episodes, group_size=3, grouped=True)
    assert [t.info["index"] for t in kept] == [0, 2, 6, 7, 8]
    assert dropped == {"episodes/dropped_failed": 3.0, "episodes/dropped_lone": 1.0}
    per_row, dropped = usable_episodes(episodes, group_size=3, grouped=False)
    assert [t.info["index"] for t in per_row] == [0, 2, 4, 6, 7, 8] and dropped["episodes/dropped_lone"] == 0.0
    # GRPO over the kept rows: each group's baseline over its survivors (serial reference, Bessel std)
    scores = torch.tensor([[0.0, t.reward] for t in kept])
    advantages, _ = get_estimator("grpo")(scores, torch.ones_like(scores), index=torch.tensor([0, 0, 2, 2, 2]))
    for row, t in enumerate(kept):
        group = [u.reward for u in kept if u.info["group"] == t.info["group"]]
        mean, std = sum(group) / len(group), float(np.std(group, ddof=1))
        assert advantages[row, 1].item() == pytest.approx((t.reward - mean) / (std + 1e-6), rel=1e-5)
    # every failure in a group of group_size 1 (no group estimator can run there): only the failed ones go
    assert usable_episodes([record(0, 1.0), record(1, 0.0, True)], group_size=1, grouped=True)[0][0].info["index"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "grpo"])
def test_a_reward_that_raises_for_one_episode_in_eight_does_not_stop_training(tiny_mid, tmp_path, estimator):
    trainer = Trainer(config_for(tiny_mid, tmp_path / "run", steps=2, estimator=estimator),
                      task=FlakyReward(lambda index: index % 8 == 3))
    history = trainer.train()  # was: KeyError: 'group' in make_batch
    assert trainer.step == 2 and len(history) == 2
    for metrics in history:
        assert metrics["episodes/dropped_failed"] == 1.0 and metrics["skipped_steps"] == 0.0
        # grpo: episode 3's partner (episode 2, the same question) has no baseline left
        assert metrics["episodes/dropped_lone"] == (1.0 if estimator == "grpo" else 0.0)
        assert metrics["finish_frac/error"] == pytest.approx(1 / 8) and np.isfinite(metrics["loss"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["episodes/dropped_failed"] for r in logged] == [1.0, 1.0]


@pytest.mark.slow
def test_a_step_whose_episodes_all_failed_is_skipped_with_a_warning(tiny_mid, tmp_path, capsys):
    trainer = Trainer(config_for(tiny_mid, tmp_path / "run", steps=2), task=FlakyReward(lambda index: index < 8))
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.train()  # was: max(): Expected reduction dim ... at the first step
    skipped = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert len(skipped) == 1 and "none of its 8 episodes" in skipped[0] and "a bug in the reward function" in skipped[0]
    assert [m["skipped_steps"] for m in history] == [1.0, 0.0]  # step 2 plays questions 4-7: it trains
    assert history[0]["episodes/dropped_failed"] == 8.0 and history[0]["success"] == 0.0
    assert "skipped: 8 episodes failed" in capsys.readouterr().out
    assert trainer.step == 2 and any(not torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())


# -- checkpoints --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> str:
    """A randomly initialised one-layer Llama with the real Qwen2.5 tokenizer and chat template: each step takes
    well under a second, so the kill lands while the workers train and save."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.helpers.testdata import qwen_tokenizer_dir

    folder = tmp_path_factory.mktemp("random") / "model"
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)




@pytest.fixture(scope="module")
def saved(random_model, tmp_path_factory) -> tuple[TrainConfig, Path]:
    """A one-step run with its checkpoint, written by the trainer (GAE: a value head in the state too)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    config = config_for(random_model, out, save_every=1, estimator="gae", max_tokens=8, max_turns=2, tensorboard=False)
    trainer = Trainer(config)
    trainer.train()
    return config, step_folder(trainer.output_dir, 1)


@pytest.mark.slow
def test_keep_checkpoints_keeps_the_newest_and_the_run_resumes_from_them(random_model, tmp_path):
    """--keep-checkpoints 2 over 4 steps saved every step: steps 3 and 4 remain (an older one is removed once a
    newer one is complete), ``latest`` names step 4, and the run goes on from it; 0 keeps them all."""
    out = tmp_path / "run"
    config = config_for(random_model, out, steps=4, save_every=1, keep_checkpoints=2, max_tokens=8, max_turns=2,
                        tensorboard=False)
    Trainer(config).train()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000003", "step_000004"]
    assert (checkpoints / "latest").read_text() == "step_000004\n"
    resumed = Trainer(config.replace(resume=str(out), steps=5))
    assert resumed.step == 4
    resumed.train()
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000004", "step_000005"]
    every = tmp_path / "every"
    Trainer(config.replace(output_dir=str(every), steps=3, keep_checkpoints=0)).train()
    assert sorted(p.name for p in (every / "checkpoints").glob("step_*")) == ["step_000001", "step_000002",
                                                                             "step_000003"]


def copy_of(saved, tmp_path) -> tuple[TrainConfig, Path]:
    config, checkpoint = saved
    target = tmp_path / "copy" / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return config.replace(resume=str(target), output_dir=str(tmp_path / "resumed"), steps=2), target


def rewrite_manifest(checkpoint: Path) -> None:
    """Sizes and sha256 of the files as they are now (a checkpoint tampered with *and* re-signed)."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name], manifest["sha256"][name] = len(data), hashlib.sha256(data).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_trainer_state_is_plain_and_every_file_has_its_sha256(saved):
    _, checkpoint = saved
    state = torch.load(checkpoint / STATE_FILE, weights_only=True)  # raises if anything in it needs code to load
    assert state["step"] == 1 and state["value_head"] is not None and isinstance(state["rng"]["numpy"], dict)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["format"] == 2 and set(manifest["sha256"]) == set(manifest["files"])
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.slow
def test_a_weights_file_damaged_at_the_same_size_is_refused_by_name(saved, tmp_path):
    config, checkpoint = copy_of(saved, tmp_path)
    weights = checkpoint / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensors: same size
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        Trainer(config)
    message = str(error.value)
    assert "\n" not in message and "damaged" in message and "model/model.safetensors" in message
    # the run folder does not fall back past the damage silently either
    with pytest.raises(CheckpointError, match="damaged: model/model.safetensors"):
        Trainer(config.replace(resume=str(checkpoint.parent.parent)))


@pytest.mark.slow
def test_non_finite_weights_are_refused_in_one_line(saved, tmp_path):
    config, checkpoint = copy_of(saved, tmp_path)
    weights = checkpoint / "model" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    rewrite_manifest(checkpoint)  # the checksums agree: only the values are wrong
    with pytest.raises(CheckpointError) as error:
        Trainer(config)
    message = str(error.value)
    assert "\n" not in message and "non-finite" in message and name.removeprefix("model.") in message


@pytest.mark.slow
def test_a_checkpoint_in_the_old_format_still_resumes_and_one_that_would_run_code_is_refused(saved, tmp_path):
    """Format 1: the numpy RNG state pickled as an array, no sha256 in the manifest: read with numpy's array
    reconstruction allowed and nothing else; RNG states restored. A state that pickles another object is refused."""
    config, checkpoint = copy_of(saved, tmp_path)
    state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    np.random.seed(7)
    legacy = np.random.get_state()
    expected = np.random.random()
    state["rng"]["numpy"] = legacy
    torch.save(state, checkpoint / STATE_FILE)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][STATE_FILE] = (checkpoint / STATE_FILE).stat().st_size
    del manifest["sha256"]
    manifest["format"] = 1
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(checkpoint / STATE_FILE, weights_only=True)  # what the old code needed weights_only=False for
    np.random.seed(0)
    resumed = Trainer(config)
    assert resumed.step == 1 and np.random.random() == expected

    state["config"]["output_dir"] = Path("/somewhere")  # a pathlib object: unpickling it runs pathlib's code
    torch.save(state, checkpoint / STATE_FILE)
    manifest["files"][STATE_FILE] = (checkpoint / STATE_FILE).stat().st_size
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as error:
        Trainer(config)
    assert "\n" not in str(error.value) and "would run code" in str(error.value) and "pathlib" in str(error.value)


# -- workers die with their launcher ------------------------------------------------------------------------

PARENT = """
import os, subprocess, sys, time
os.environ["AGENT_LOOP_LAUNCHER_PID"] = str(os.getpid())  # as relaunch_under_torchrun does
child = subprocess.Popen([sys.executable, "-c", "from agent_loop.training.distributed import die_with_launcher; "
                          "die_with_launcher(poll_s=60); print('armed', flush=True); import time; time.sleep(120)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.integration
def test_a_worker_in_its_own_session_dies_when_its_parent_is_killed():
    """As torchrun starts them (start_new_session): no process-group signal reaches the worker, its parent-death
    signal does."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=ENV, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline().strip() == "armed"  # the child's own line (its stdout is the parent's)
    assert alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    gone, running = psutil.wait_procs([child], timeout=3)  # the parent-death signal, not the 60 s watch
    assert not running, "the worker outlived its parent"


def checkpoint_names(run: Path) -> set[str]:
    folder = run / "checkpoints"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def written_after(run: Path, moment: float) -> list[str]:
    """The files under ``run`` modified after ``moment`` (a time.time()), and a checkpoint folder's own entries."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.stat().st_mtime > moment)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_nproc_2_workers_exit_when_the_launcher_is_sigkilled(tmp_path):
    """Issue 49 item 7, on the tiny agent: the launcher SIGKILLed while its two workers train and save every step;
    they are gone within seconds, and no metrics line, checkpoint or other file is written after the kill
    (a step of the tiny agent takes seconds here: one more logged step would land well after it)."""
    run = tmp_path / "run"
    argv = ["--model", "tiny", "--nproc", "2", "--steps", "100000", "--prompts-per-step", "2", "--group-size", "2",
            "--mini-batches", "1", "--micro-batch-size", "4", "--concurrency", "2", "--save-every", "1",
            "--max-tokens", "8", "--max-turns", "2", "--threads", "1", "--output-dir", str(run), "--no-progress",
            "--no-tensorboard"]
    launcher = subprocess.Popen([sys.executable, "-m", "agent_loop.cli", "train", *argv], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline and launcher.poll() is None and "step_000001" not in checkpoint_names(run):
        time.sleep(0.2)
    assert launcher.poll() is None, launcher.stderr.read()[-3000:]
    assert "step_000001" in checkpoint_names(run), "no checkpoint within the deadline"
    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "agent_loop.recipes" in " ".join(p.cmdline())]
    assert len(workers) == 2, [p.cmdline() for p in workers]
    killed = time.time()
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    gone, running = psutil.wait_procs(workers, timeout=10)
    assert not running, f"workers {[p.pid for p in running]} still running 10 s after the launcher was killed"
    assert time.time() - killed < 5, "the workers took more than a few seconds to go"
    # a write already in its last system call when the signal came may finish: a quarter of a second
    assert written_after(run, killed + 0.25) == [], "written after the launcher was killed"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and steps, steps  # whole lines only, in order
    assert len([n for n in checkpoint_names(run) if n.startswith("step_")]) >= 1


# a worker on a platform without the parent-death signal (or where prctl failed): only its own checks stop it
ORPHAN = """
import ctypes, sys, time
from pathlib import Path
from agent_loop.training.distributed import die_with_launcher
import agent_loop.files as files
from agent_loop.runners.jsonl import JsonlWriter
from agent_loop.training.metrics import MetricsLogger
out, kind = Path(sys.argv[1]), sys.argv[2]
die_with_launcher(poll_s=600)
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0: no parent-death signal
files.write_text(out / "before.txt", "the launcher is alive")  # the check lets a live launcher's worker write
print("armed", flush=True)
while not (out / "go").exists():
    time.sleep(0.05)
if kind == "file":
    files.write_text(out / "latest", "step_000002")
elif kind == "folder":
    files.write_folder(out / "step_000002", lambda d: (d / "model.safetensors").write_text("x"))
elif kind == "line":
    JsonlWriter(out / "rollouts.jsonl", mode="append").write_line("{}")
else:
    MetricsLogger(out, fresh=False, tensorboard=False).log(2, {"loss": 0.5})
print("wrote", flush=True)
"""
LAUNCHER = """
import os, subprocess, sys, time
os.environ["AGENT_LOOP_LAUNCHER_PID"] = str(os.getpid())  # as relaunch_under_torchrun does
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["folder", "metrics"])  # a checkpoint, a step's line
def test_a_worker_whose_launcher_died_writes_nothing_even_without_the_parent_death_signal(tmp_path, kind):
    """Issue 49 item 7: the check of the launcher before each write (a file or folder renamed into place, a
    rollout or metrics line appended) stops the worker there: without it the worker, whose 600 s watch has not
    yet looked, would write its checkpoint or line after its launcher died."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, ORPHAN, str(tmp_path), kind], env=ENV,
                                stdout=subprocess.PIPE, text=True)
    worker = psutil.Process(int(launcher.stdout.readline()))
    assert launcher.stdout.readline().strip() == "armed"  # the worker's line (its stdout is the launcher's)
    assert (tmp_path / "before.txt").read_text() == "the launcher is alive"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    assert alive(worker)  # no parent-death signal came
    (tmp_path / "go").write_text("")
    gone, running = psutil.wait_procs([worker], timeout=60)
    assert not running and "wrote" not in launcher.stdout.read()  # stopped at the write, not after it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before.txt", "go"]  # nothing, not even a temporary file


def test_metrics_lines_are_strict_json_even_with_a_nan_loss(tmp_path):
    from agent_loop.training.metrics import MetricsLogger

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": float("nan"), "kl": float("inf"), "reward/mean": 0.5})
    [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "loss": None, "kl": None, "reward/mean": 0.5}
