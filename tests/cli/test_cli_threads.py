"""Every command takes ``--threads``; one default rule (agent_loop.threads) that does not oversubscribe shared
cores; ``--threads 0`` is a one-line usage error (issue 36 item 4)."""

import os
import subprocess
import sys

import pytest

from agent_loop.cli import COMMANDS, main
from agent_loop.threads import default_threads, resolve_threads

COMMAND_ARGS = {  # the least each command needs to reach its option checks
    "rollout": [], "train": [], "warmstart": [], "serve": ["--dry-run"], "tiny": [], "inspect": ["missing.jsonl"],
    "proxy": [], "models": [], "verl-check": [],
}


def command_names() -> list[str]:
    """The command names (a module per command: ``verl_check`` is ``verl-check``)."""
    return [module.add_parser.__module__.rsplit(".", 1)[1].replace("_", "-") for module in COMMANDS]


def test_every_command_has_threads_in_its_help(capsys):
    assert set(command_names()) <= set(COMMAND_ARGS), "a new command: add it to COMMAND_ARGS"
    for name in command_names():
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert "--threads THREADS" in capsys.readouterr().out, name


@pytest.mark.parametrize("name", command_names())
def test_threads_0_is_one_line_and_exit_2(capsys, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing is written even if a check came too late
    assert main([name, *COMMAND_ARGS[name], "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"agent-loop {name}: error: --threads 0: must be an integer >= 1 (or unset)"]
    assert list(tmp_path.iterdir()) == []


def test_the_rule_shares_the_cores_and_leaves_busy_ones_alone():
    assert default_threads(cores=2, processes=1, load=0.0) == 2  # a quiet machine: every core
    assert default_threads(cores=8, processes=4, load=0.0) == 2  # torchrun's processes share them
    assert default_threads(cores=2, processes=1, load=1.2) == 1  # one core already busy
    assert default_threads(cores=2, processes=1, load=11.0) == 1  # loaded: 1, never 0
    assert default_threads(cores=2, processes=3, load=0.0) == 1


def test_given_threads_and_omp_num_threads_come_before_the_rule(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_threads(5) == 5 and resolve_threads(None) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert resolve_threads(None) == default_threads()


def test_apply_threads_sets_torch_intra_and_interop_threads():
    code = ("import torch; from agent_loop.threads import apply_threads; n = apply_threads(None); "
            "print(n, torch.get_num_threads(), torch.get_num_interop_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    used, intra, interop = map(int, out.split())
    assert used == intra >= 1 and interop == 1
    assert used <= len(os.sched_getaffinity(0))


def test_serve_binds_vllm_to_the_threads_it_is_given(capsys, tiny_agent_dir, monkeypatch):
    import agent_loop.model_folders

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the rule, not the test worker's core
    monkeypatch.setattr(agent_loop.model_folders, "vllm_on_cpu", lambda: True)
    assert main(["serve", "--model", str(tiny_agent_dir), "--dry-run", "--threads", "1"]) == 0
    env_line = capsys.readouterr().out.splitlines()[0]
    first_core = sorted(os.sched_getaffinity(0))[0]
    assert f"VLLM_CPU_OMP_THREADS_BIND={first_core} " in env_line
