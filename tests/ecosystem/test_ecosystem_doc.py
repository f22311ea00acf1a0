"""docs/ecosystem.md's commands parse and validate as written (flags, task names, task options, the rules across
options), and its YAML example loads the composite it describes; running them is the other tests' job."""

import re
import shlex
import sqlite3
from pathlib import Path

import pytest

from agent_loop.cli import build_parser
from agent_loop.cli.config_file import read_config
from agent_loop.cli.flags import resolve, validate
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.tasks.registry import TaskOptions

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ecosystem.md"
ROW = '{"prompt": [{"role": "user", "content": "2+2?"}], "reward_spec": {"ground_truth": "4"}, "db_id": "d", "data": "spider"}\n'


def commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S)
    lines = [line.split("  #")[0] for line in "\n".join(blocks).splitlines()]
    return [shlex.join(shlex.split(line)[1:]) for line in lines if line.startswith("agent-loop ")]


def test_the_page_has_commands_for_each_source():
    assert {re.search(r"--task (\w+):", c).group(1) for c in commands()} == {"reasoning_gym", "skyrl_gym"}


@pytest.mark.parametrize("command", commands())
def test_a_command_parses_and_validates(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(shlex.split(command))
    options = resolve(RolloutOptions, args)
    if options.prompts:  # the rows the command names, and text2sql's database folder
        Path(options.prompts).write_text(ROW)
    if "db_path" in options.task_options:  # the page's /data/sql_data, made here as a real SQLite folder
        folder = tmp_path / "db" / "spider" / "database" / "d"
        folder.mkdir(parents=True)
        sqlite3.connect(folder / "d.sqlite").close()
        options.task_options["db_path"] = str(tmp_path / "db")
    assert options.load().name == options.task


def test_the_yaml_example_loads_its_composite(tmp_path):
    text = re.search(r"```yaml\n(.*?)```", PAGE.read_text(), flags=re.S).group(1)
    (tmp_path / "run.yaml").write_text(text)
    values = read_config(tmp_path / "run.yaml", RolloutOptions)
    task = validate(TaskOptions, {k: values[k] for k in ("task", "task_options")}).load()
    assert task.name == "reasoning_gym:composite" and task.size == 200
    assert {e["metadata"]["source_dataset"] for e in (task.dataset[i] for i in range(40))} == {"chain_sum", "basic_arithmetic"}
