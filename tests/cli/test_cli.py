"""Bad input to ``agent-loop rollout`` / ``train``: one line naming the option, exit 2, before anything
starts (issue 15; the table of cases is docs/errors.md). Also: help text, the server probe against real
HTTP servers on 127.0.0.1, the real cause when every episode errored, and a clean vLLM exit."""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from advantages import ESTIMATORS
from agent_loop.cli import build_parser, main
from agent_loop.cli.flags import UsageError
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.cli.train import options_from as train_validate
from agent_loop.model_folders import VLLM_CPU_HEAD_SIZES
from agent_loop.options import flatten
from agent_loop.recipes.train_options import TrainConfig


def command_parser(name: str):
    """The subparser of ``agent-loop NAME``."""
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return subparsers.choices[name]


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``main(argv)`` in-process; (exit status, stderr). argparse's own errors exit via SystemExit."""
    started = time.perf_counter()
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    assert time.perf_counter() - started < 30, "a usage error must be reported before any work starts"
    return code, capsys.readouterr().err


def model_folder(root: Path, *, config=True, tokenizer=True, template=True, head_dim=32) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config:
        (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": head_dim * 4,
                                                      "num_attention_heads": 4}))
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
    if template:
        (root / "chat_template.jinja").write_text("{{ messages }}")
    return root


# --- rollout: every case of issue 15, each with the exact message ---------------------------------------

ROLLOUT_CASES = [
    (["--concurrency", "-1"], "--concurrency -1: must be an integer >= 1"),
    (["--concurrency", "0"], "--concurrency 0: must be an integer >= 1"),
    (["--task", "nope"], "--task nope: unknown task (choose one of arithmetic, chain, keydoor, lookup)"),
    (["--task", "arithmetc"], "--task arithmetc: unknown task; did you mean arithmetic?"),
    (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),
    (["--max-parallel-tool-calls", "0"], "--max-parallel-tool-calls 0: must be an integer >= 1"),
    (["--episodes", "0"], "--episodes 0: must be an integer >= 1"),
    (["--episodes", "-5"], "--episodes -5: must be an integer >= 1"),
    (["--episodes", "1.5"], "--episodes 1.5: must be an integer >= 1"),
    (["--max-turns", "0"], "--max-turns 0: must be an integer >= 1"),
    (["--max-tokens", "0"], "--max-tokens 0: must be an integer >= 1"),
    (["--max-response-tokens", "0"], "--max-response-tokens 0: must be an integer >= 1"),
    (["--max-observation-tokens", "0"], "--max-observation-tokens 0: must be an integer >= 1"),
    (["--backend", "http", "--server", "not-a-url"], "--server not-a-url: not an http(s) URL"),
    (["--backend", "http"], "--backend http: needs at least one --server URL"),
    (["--backend", "hf", "--server", "http://127.0.0.1:8000"], "--server http://127.0.0.1:8000: used by --backend http only"),
    (["--backend", "foo"], "--backend foo: must be one of auto, hf, vllm, http"),
    (["--tool-timeout-s", "-1"], "--tool-timeout-s -1: must be a number > 0"),
    (["--temperature", "-1"], "--temperature -1: must be a number >= 0"),
    (["--top-p", "2"], "--top-p 2: must be a number > 0 and <= 1"),
    (["--top-p", "nan"], "--top-p nan: must be a number > 0 and <= 1"),
    (["--top-k", "-1"], "--top-k -1: must be an integer >= 0"),
    (["--gamma", "1.5"], "--gamma 1.5: must be a number >= 0 and <= 1"),
    (["--estimator", "grpo"], "--estimator grpo: compares samples of the same question; needs --group-size 2 or "
                              "more (got 1)"),
    (["--estimator", "gae"], "--estimator gae: needs critic values, which a file of rollouts lacks (agent-loop train "
                             "--estimator gae trains a critic; choose one of"),
    (["--estimator", "reinforce_plus_pls"], "--estimator reinforce_plus_pls: unknown advantage estimator; "
                                            "did you mean reinforce_plus_plus?"),
    (["--seed", "x"], "--seed x: must be an integer >= 0"),
    (["--backend", "vllm", "--task", "nope"], "--task nope: unknown task"),  # found before the engine starts
]


@pytest.mark.parametrize("argv, message", ROLLOUT_CASES, ids=[" ".join(c[0]) for c in ROLLOUT_CASES])
def test_rollout_rejects_bad_option_in_one_line_with_exit_2(capsys, tmp_path, argv, message):
    out = tmp_path / "kept.jsonl"
    out.write_text("earlier run\n")
    code, err = run_cli(capsys, "rollout", *argv, "--out", str(out))
    assert code == 2
    assert err.strip().splitlines() == [f"agent-loop rollout: error: {err.strip().split('error: ', 1)[1]}"]
    assert message in err
    assert "Traceback" not in err
    assert out.read_text() == "earlier run\n"  # nothing touched


def test_rollout_rejects_out_folder_and_bad_model_folders(capsys, tmp_path):
    code, err = run_cli(capsys, "rollout", "--out", str(tmp_path))
    assert code == 2 and f"--out {tmp_path}: is a folder; give a file path" in err

    cases = {
        "no_config": (model_folder(tmp_path / "a", config=False), "not a model folder (no config.json)"),
        "no_tokenizer": (model_folder(tmp_path / "b", tokenizer=False), "no tokenizer files"),
        "no_template": (model_folder(tmp_path / "c", template=False), "the tokenizer has no chat template"),
    }
    for folder, message in cases.values():
        code, err = run_cli(capsys, "rollout", "--model", str(folder), "--out", str(tmp_path / "r.jsonl"))
        assert code == 2 and f"--model {folder}: {message}" in err, err
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    code, err = run_cli(capsys, "rollout", "--model", str(a_file))
    assert code == 2 and "not a folder" in err
    assert not (tmp_path / "r.jsonl").exists()


def test_rollout_vllm_checks_head_size_before_the_engine(capsys, tmp_path):
    pytest.importorskip("vllm")
    from agent_loop.model_folders import vllm_on_cpu

    if not vllm_on_cpu():
        pytest.skip("the head-size rule is vLLM's CPU attention's")
    folder = model_folder(tmp_path / "m", head_dim=16)
    code, err = run_cli(capsys, "rollout", "--backend", "vllm", "--model", str(folder))
    assert code == 2
    assert f"--model {folder}: " in err and "head size 16 is not supported by vLLM's CPU attention" in err
    assert 16 not in VLLM_CPU_HEAD_SIZES and 32 in VLLM_CPU_HEAD_SIZES


# --- servers: probed once, concurrently, at start ----------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(handler) -> tuple[str, http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_unreachable_and_static_servers_are_named_at_start(capsys, tmp_path, tiny_agent_dir):
    (tmp_path / "index.html").write_text("<html>a static site</html>")
    static, server = serve(lambda *a, **k: _Quiet(*a, directory=str(tmp_path), **k))
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        started = time.perf_counter()
        code, err = run_cli(capsys, "rollout", "--backend", "http", "--server", static, "--server", dead + "/v1",
                            "--model", str(tiny_agent_dir), "--out", str(tmp_path / "r.jsonl"))
        elapsed = time.perf_counter() - started
    finally:
        server.shutdown()
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert f"--server {static}: not an OpenAI-compatible server (GET /v1/models returned HTTP 404)" in err
    assert f"--server {dead}: unreachable" in err  # the trailing /v1 is dropped
    assert elapsed < 15  # one probe each, at once; not ~23 s per episode
    assert not (tmp_path / "r.jsonl").exists()


class _ModelsOnly(http.server.BaseHTTPRequestHandler):
    """Lists one model at /v1/models; every other request gets 404 (a half-configured gateway)."""

    served = "?"

    def do_GET(self):
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": self.served, "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.mark.timeout(120)
def test_every_episode_failing_reports_the_real_cause(capsys, tmp_path, tiny_agent_dir):
    handler = type("Handler", (_ModelsOnly,), {"served": str(tiny_agent_dir)})
    url, server = serve(handler)
    out = tmp_path / "r.jsonl"
    try:
        code = main(["rollout", "--backend", "http", "--server", url, "--model", str(tiny_agent_dir),
                     "--episodes", "3", "--concurrency", "3", "--out", str(out)])
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert code == 1
    assert "Bessel" not in captured.err + captured.out
    assert "every episode (3) ended in an error; first: episode" in captured.err
    assert "HTTP 404" in captured.err
    assert len(out.read_text().splitlines()) == 3  # the episodes are still written


@pytest.mark.timeout(60)
def test_probe_reports_a_model_the_server_does_not_serve(capsys, tmp_path, tiny_agent_dir):
    handler = type("Handler", (_ModelsOnly,), {"served": "some-other-model"})
    url, server = serve(handler)
    try:
        code, err = run_cli(capsys, "rollout", "--backend", "http", "--server", url, "--model", str(tiny_agent_dir))
    finally:
        server.shutdown()
    assert code == 2 and f"--server {url}: serves ['some-other-model'], not '{tiny_agent_dir}'" in err


# --- train ---------------------------------------------------------------------------------------------------

TRAIN_CASES = [
    (["--resume", "/nonexistent"], "--resume /nonexistent: no such folder"),
    (["--estimator", "nope"], "--estimator nope: unknown advantage estimator "
                              f"(choose one of {', '.join(sorted(ESTIMATORS))})"),
    (["--estimator", "rloo_"], "did you mean rloo?"),
    (["--save-every", "0"], "--save-every 0: must be an integer >= 1"),
    (["--lr", "-1"], "--lr -1: must be a number > 0"),
    (["--lr", "inf"], "--lr inf: must be a number > 0"),
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
    (["--eval-every", "-1"], "--eval-every -1: must be an integer >= 0"),
    (["--kl-kind", "k4"], "--kl-kind k4: unknown KL estimator"),
    (["--tiny-stage", "late"], "--tiny-stage late: must be one of mid, final"),
    (["--task", "nope"], "--task nope: unknown task"),
    (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),
    (["--estimator", "grpo"], "--estimator grpo: compares samples of the same question; needs --group-size 2"),
]


@pytest.mark.parametrize("argv, message", TRAIN_CASES, ids=[" ".join(c[0]) for c in TRAIN_CASES])
def test_train_rejects_bad_option_in_one_line_with_exit_2(capsys, argv, message):
    code, err = run_cli(capsys, "train", *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("agent-loop train: error: ")
    assert message in err


def test_train_refuses_wandb_when_it_is_not_installed(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    code, err = run_cli(capsys, "train", "--wandb-project", "p")
    assert code == 2 and "--wandb-project p: wandb is not installed (pip install wandb)" in err


def test_train_checks_resume_and_output_dir(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--resume", str(tmp_path))
    assert code == 2 and f"--resume {tmp_path}: not a checkpoint (no trainer_state.pt" in err
    (tmp_path / "trainer_state.pt").write_bytes(b"")
    code, err = run_cli(capsys, "train", "--resume", str(tmp_path))
    assert code == 2 and f"--resume {tmp_path / 'model'}: no such folder" in err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run_cli(capsys, "train", "--output-dir", str(blocker / "run"))
    assert code == 2 and f"--output-dir {blocker / 'run'}: {blocker} is a file, not a folder" in err


def test_config_file_keys_get_the_same_checks():
    assert train_validate({"lr": "1e-3", "steps": 3}, keys=True).update.lr == 1e-3
    with pytest.raises(UsageError, match=r"^save_every 0: must be an integer >= 1$"):
        train_validate({"save_every": 0}, keys=True)
    with pytest.raises(UsageError, match=r"^unknown key stpes; did you mean steps\?$"):
        train_validate({"stpes": 3}, keys=True)
    with pytest.raises(UsageError, match=r"^mini_batches 3: must divide"):
        train_validate({"prompts_per_step": 4, "mini_batches": 3}, keys=True)


# --- inspect (its parsing; the inspect views own the rest) ----------------------------------------------

INSPECT_CASES = [
    (["--episode", "-1"], "argument --episode: -1: must be an integer >= 0"),
    (["--max-episodes", "0"], "argument --max-episodes: 0: must be an integer >= 1"),
    (["--worst", "0"], "argument --worst: 0: must be an integer >= 1"),
    (["--width", "5"], "argument --width: 5: must be an integer >= 20"),
    (["--gamma", "2"], "argument --gamma: 2: must be a number >= 0 and <= 1"),
]


@pytest.mark.parametrize("argv, message", INSPECT_CASES, ids=[" ".join(c[0]) for c in INSPECT_CASES])
def test_inspect_rejects_bad_option_with_exit_2(capsys, tmp_path, argv, message):
    code, err = run_cli(capsys, "inspect", str(tmp_path / "r.jsonl"), *argv)
    assert code == 2 and f"agent-loop inspect: error: {message}" in err


# --- help ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, config", [("rollout", RolloutOptions), ("train", TrainConfig)])
def test_every_option_has_help_with_allowed_values_and_default(command, config):

    actions = {a.dest: a for a in command_parser(command)._actions
               if a.dest not in ("help", "config") and a.help != argparse.SUPPRESS}  # hidden: a replaced option
    assert set(actions) == set(flatten(config()))  # one flag per declared option (TrainConfig: of its sub-configs)
    for name, action in actions.items():
        assert action.help and "default: " in action.help and "[" in action.help, name
        assert len(action.help.split("[")[0].strip()) > 3, f"{name} has no description"


LOOP_OPTIONS = ["history_mode", "on_template_mismatch", "top_p", "top_k", "tool_timeout_s", "max_observation_tokens",
                "max_parallel_tool_calls", "backend_retries", "retry_backoff_s"]


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_every_loop_option_is_a_flag_and_a_key_of_both_commands(command, tmp_path):
    """Each loop option is declared once (LoopConfig) and reaches both commands, as a flag and a YAML key,
    with the same help text and the same constraint."""
    import dataclasses

    from agent_loop.cli.flags import resolve
    from agent_loop.episode.loop_config import LoopConfig

    parser = command_parser(command)
    helps = {a.dest: a.help for a in parser._actions}
    for field in dataclasses.fields(LoopConfig):
        assert field.name in helps, field.name
        assert helps[field.name] == {a.dest: a.help for a in command_parser("rollout")._actions}[field.name] \
            or field.name in ("max_turns", "max_tokens", "max_response_tokens")  # train's defaults differ
    values = {"history_mode": "keep_seen", "on_template_mismatch": "error", "top_p": 0.5, "top_k": 7,
              "tool_timeout_s": 3.5, "max_observation_tokens": 99, "max_parallel_tool_calls": 2, "backend_retries": 0,
              "retry_backoff_s": 0.25}
    path = tmp_path / "run.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in values.items()))
    options = resolve(RolloutOptions if command == "rollout" else TrainConfig,
                      parser.parse_args(["--config", str(path), "--top-k", "9"]))
    assert {k: flatten(options)[k] for k in values} == {**values, "top_k": 9}
    with pytest.raises(UsageError, match="^--top-p 0: must be a number > 0 and <= 1$"):
        resolve(TrainConfig if command == "train" else RolloutOptions, parser.parse_args(["--top-p", "0"]))


def test_help_exits_0_and_lists_allowed_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["rollout", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "one of auto, hf, vllm, http; default: auto" in text
    assert "one of arithmetic, chain, keydoor, lookup; default: arithmetic" in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("unset: train scales 0.0002 to the batch (0.0002 x episodes per AdamW step / 32, at most 0.0002); "
            "warmstart takes 0.003") in text and "[a number > 0 (or unset); default: none]" in text
    assert f"one of {', '.join(sorted(ESTIMATORS))}; default: reinforce_plus_plus" in text


@pytest.mark.timeout(30)
def test_probe_names_a_server_that_never_answers():
    import socket

    from agent_loop.cli.preflight import probe_servers

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts connections (the kernel does) but never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        started = time.perf_counter()
        with pytest.raises(UsageError, match=rf"^--server {url}: no answer within 0.5 s \(GET /v1/models\)$"):
            probe_servers([url], timeout_s=0.5)
        assert time.perf_counter() - started < 5
    finally:
        listener.close()


def test_default_out_never_touches_an_earlier_run(tmp_path, monkeypatch):
    from agent_loop.cli.rollout import options_from as validate

    monkeypatch.chdir(tmp_path)
    assert validate({}).out == "runs/rollouts.jsonl"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "rollouts.jsonl").write_text("{}\n")
    (tmp_path / "runs" / "rollouts-2.jsonl").write_text("{}\n")
    assert validate({}).out == "runs/rollouts-3.jsonl"  # README's command, run again: a new file
    assert validate({"resume": True}).out == "runs/rollouts.jsonl"  # --resume continues the default file
    assert validate({"out": "mine.jsonl"}).out == "mine.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["reinforce_plus_plus_reset_at_observation", "reinforce_plus_plus_ignore_mask"])
def test_rollout_summary_shows_the_chosen_estimator(capsys, tmp_path, tiny_agent_dir, estimator):
    """The returns table is computed by the estimator named on the command line, checked against the
    serial references (tests/helpers/reference_returns.py) on the episodes written."""
    import re

    from agent_loop.runners.batch import trajectories_to_batch
    from agent_loop.runners.local import read_trajectories
    from tests.helpers.reference_returns import (
        discounted_returns_ref,
        returns_ignore_mask_ref,
        returns_reset_at_observation_ref,
    )

    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--model", str(tiny_agent_dir), "--episodes", "6", "--gamma", "0.9",
                 "--estimator", estimator, "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps the title to the table's width
    assert f"batch tensors and {estimator} (gamma=0.9)" in printed
    batch = trajectories_to_batch(sorted(read_trajectories(out), key=lambda t: t.info["index"]))
    if estimator.endswith("reset_at_observation"):
        expected = returns_reset_at_observation_ref(batch.token_level_rewards, batch.response_mask, 0.9)
    else:
        expected = returns_ignore_mask_ref(batch.token_level_rewards, 0.9)
    assistant = batch.response_mask.bool()
    carry_through = discounted_returns_ref(batch.token_level_rewards, batch.spans, 0.9)[assistant].mean().item()
    assert expected[assistant].mean().item() != pytest.approx(carry_through, abs=1e-3)  # the choice shows
    shown = float(re.search(r"mean return on ASSISTANT tokens\D*([-\d.]+)", printed).group(1))
    assert shown == pytest.approx(expected[assistant].mean().item(), abs=1e-4)


def test_a_rule_across_options_names_them_as_flags_or_as_keys():
    from agent_loop.options import OptionError

    error = OptionError("mini_batches", "must divide {prompts_per_step} x {group_size}", 3)
    assert str(error) == "mini_batches 3: must divide prompts_per_step x group_size"
    assert error.render(lambda n: "--" + n.replace("_", "-")) == "--mini-batches 3: must divide --prompts-per-step x --group-size"
    assert str(OptionError(None, "give either {task} or {prompts}")) == "give either task or prompts"


def test_the_saved_train_config_records_the_learning_rate_used():
    config = train_validate({"prompts_per_step": 8, "mini_batches": 2})
    # unset: scaled to the batch, and kept as the run uses it
    assert config.update.lr == config.resolved()["lr"] == config.learning_rate == pytest.approx(2e-4 * 4 / 32)
