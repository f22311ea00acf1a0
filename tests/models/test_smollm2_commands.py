"""The real built-in model through the commands the smoke test (test_smollm2_smoke.py) does not play (issue 36
item 2): a rollout over HTTP through a real ``agent-loop serve`` with a real tool round trip, then ``agent-loop
inspect`` of its file; one full fine-tuning ``train`` step, then ``inspect`` of the run folder; an asynchronous
``train --max-staleness 1`` run. Small sizes: each checks that the command runs the real model end to end;
whether it learns is docs/results/ablation_smollm2.md's question."""

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from agent_loop.backends.openai_http import OpenAIHTTPBackend
from agent_loop.backends.vllm_server import free_port, stop_process_group, wait_healthy
from agent_loop.cli import main
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.model_folders import check_model_dir
from agent_loop.runners.local import run_rollouts
from tests.helpers.copy_call import CopyCall

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL_TRAIN = ["--model", "smollm2-135m", "--task", "arithmetic", "--prompts-per-step", "2", "--group-size", "2",
               "--max-tokens", "24", "--max-turns", "2", "--threads", "1", "--no-progress", "--no-tensorboard",
               "--entropy-coef", "0.01"]  # the base model never calls the tool: every reward is 0, the entropy term moves it


def metrics_of(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_rollout_over_http_through_agent_loop_serve_then_inspect(smollm2_dir, tmp_path, capsys):
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as output:
        server = subprocess.Popen([sys.executable, "-m", "agent_loop.cli", "serve", "--model", "smollm2-135m",
                                   "--port", str(port), "--threads", "1"],
                                  stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    url, out = f"http://127.0.0.1:{port}", tmp_path / "episodes.jsonl"
    try:
        wait_healthy(url, server, timeout_s=600, name="agent-loop serve", log_path=log)

        async def play():
            async with OpenAIHTTPBackend([url], "policy") as backend:
                return await run_rollouts(CopyCall(), backend, check_model_dir(smollm2_dir).tokenizer, range(2),
                                          LoopConfig(temperature=0.0, max_turns=2, max_tokens=32), concurrency=2,
                                          output_path=out, progress=False)

        trajectories = asyncio.run(play())
    finally:
        stop_process_group(server)
    for traj in trajectories:  # the served model's turns, token for token as the template renders them
        assert traj.reward == 1.0 and traj.metrics["template_exact"], traj.messages
        assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
        assert traj.messages[2]["content"] == "BLUE" and "BLUE" in traj.messages[-1]["content"]
    assert len(out.read_text().splitlines()) == 2
    html = tmp_path / "view.html"
    assert main(["inspect", str(out), "--all", "--html", str(html), "--width", "120"]) == 0, capsys.readouterr().err
    shown = capsys.readouterr().out
    assert "BLUE" in shown and "echo" in shown  # the tool's answer among the tokens shown
    assert "BLUE" in html.read_text()


@pytest.mark.timeout(900)
def test_one_full_fine_tuning_step_changes_every_weight_and_inspect_shows_the_run(smollm2_dir, tmp_path, capsys):
    """With the turn-level estimator gigpo (issue 47: ``agent-loop train --estimator gigpo --model smollm2-135m``):
    its step file records each turn's anchor-state group, and ``inspect`` shows the per-turn view of it."""
    run = tmp_path / "train"
    assert main(["train", *SMALL_TRAIN, "--estimator", "gigpo", "--steps", "1", "--output-dir", str(run)]) == 0, \
        capsys.readouterr().err
    (step,) = metrics_of(run)
    assert step["step"] == 1 and step["grad_norm"] > 0
    before = load_file(f"{smollm2_dir}/model.safetensors")
    after = load_file(next((run / "checkpoints").glob("step_000001/**/model.safetensors")))
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved == set(before), sorted(set(before) - moved)[:5]  # full fine-tuning: no tensor left as it was
    capsys.readouterr()
    assert main(["inspect", str(run), "--png", str(tmp_path / "run.png")]) == 0, capsys.readouterr().err
    assert "step" in capsys.readouterr().out and (tmp_path / "run.png").stat().st_size > 0
    path = run / "rollouts" / "step_000001.jsonl"
    trained = [e for e in map(json.loads, path.read_text().splitlines()) if e["info"]["trained"]]
    assert len(trained) == 4 and all(e["info"]["estimator"] == "gigpo" for e in trained)
    for e in trained:  # one anchor group per assistant turn; the first turn's holds the question's other sample
        turns = len({k for k, s in zip(e["turn_ids"], e["spans"]) if s == 1})
        assert len(e["info"]["anchor_groups"]) == turns and e["info"]["anchor_others"][0] >= 1
    assert main(["inspect", str(path), "--all", "--width", "200"]) == 0, capsys.readouterr().err
    shown = capsys.readouterr().out
    assert "per turn (as trained at step 1, estimator gigpo)" in shown and "anchor group" in shown


@pytest.mark.timeout(900)
def test_an_asynchronous_run_trains_on_episodes_at_most_one_step_stale(smollm2_dir, tmp_path, capsys):
    run = tmp_path / "async"
    assert main(["train", *SMALL_TRAIN, "--steps", "2", "--max-staleness", "1", "--mini-batches", "1",
                 "--backend", "hf", "--output-dir", str(run)]) == 0, capsys.readouterr().err
    steps = metrics_of(run)
    assert [m["step"] for m in steps] == [1, 2]
    for metrics in steps:
        assert metrics["staleness/max"] <= 1 and metrics["staleness/k0"] + metrics.get("staleness/k1", 0) == 4
    for step in (1, 2):  # step s trains the weights of version s - 1 on tokens sampled by version s - 2 or later
        records = [json.loads(line) for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(records) == 4
        for record in records:
            assert len(record["policy_versions"]) == len(record["response_ids"])
            assert max(step - 2, 0) <= min(record["policy_versions"]) <= max(record["policy_versions"]) <= step - 1

