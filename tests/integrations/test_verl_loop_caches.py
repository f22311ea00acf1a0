"""The verl AgentLoop's per-config caches (verl's base attributes once per config, the reward terms once per
options) in verl's real ``AgentLoopWorker``: ``verl_side/loop_caches_run.py`` runs in the verl 0.9.1 side
environment; a changed config gets its own entry, a row's task is the one a fresh ``DatasetTask`` gives, and
two rows share no mutable state."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.testdata import qwen_tokenizer_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".side-envs" / "verl-0.9.1" / "bin" / "python"
SCRIPT = Path(__file__).resolve().parent / "verl_side" / "loop_caches_run.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    assert SIDE_PYTHON.exists(), (f"the verl 0.9.1 side environment is missing ({SIDE_PYTHON}); build it with "
                                  "`bash scripts/side_env.sh verl-0.9.1`")
    work = tmp_path_factory.mktemp("verl_loop_caches")
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(SIDE_PYTHON), str(SCRIPT), str(qwen_tokenizer_dir()), str(work)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, f"the verl side script failed:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    return json.loads((work / "result.json").read_text())


def test_verls_base_attributes_are_verls_own_once_per_config(result):
    assert result["base_keys_match"]
    assert result["base_values_match"] and all(result["base_values_match"].values()), result["base_values_match"]
    assert "continuous_token_builder" in result["base_values_match"]
    assert result["base_entries_after_two_rows"] == 1
    assert result["event_loop_is_running_loop"]
    assert result["dict_attributes_shared"] == []


def test_a_changed_config_gets_its_own_entry(result):
    assert result["base_entries_after_changed_config"] == 2
    assert result["changed_config_reads_its_own"]
    assert result["changed_reward_terms"] == [["number_close#0", 1.0], ["number_close#1", 0.5]]


def test_a_rows_task_is_a_fresh_dataset_tasks(result):
    assert result["episode_matches_fresh_task"]
    assert result["reward_matches_fresh_task"] == [1.0, 1.0]
    assert result["task_attributes_match"] == []
    assert result["reward_names_match"]
    assert result["row_indices"] == [0, 1]


def test_rows_share_no_mutable_state(result):
    assert result["shared_between_rows"] == []
    assert result["tool_rewards"] == [[0.5], [0.5]]  # verl's CodeLookupTool step_reward, once per row
    assert not result["tool_rewards_shared"]
    assert not result["messages_shared"]
