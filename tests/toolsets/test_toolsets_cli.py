"""``agent-loop rollout --mcp-server`` and ``--tools python`` as a user runs them: the tiny agent calls a real
MCP server's calculator (examples/mcp_server.py); the option is the same key in YAML; bad values are one line."""

import json
import sys
from pathlib import Path

import pytest

from agent_loop.cli import main
from agent_loop.cli.rollout import options_from
from agent_loop.runners.local import read_trajectories

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mcp_server.py"


def test_mcp_server_is_a_repeatable_flag_and_a_yaml_key(tmp_path):
    flags = options_from({"mcp_server": ["python a.py", "http://127.0.0.1:8000/mcp"]})
    assert flags.mcp_server == ["python a.py", "http://127.0.0.1:8000/mcp"]
    config = tmp_path / "run.yaml"
    config.write_text("task: arithmetic\nmcp_server:\n  - python a.py\ntools: python\n")
    from agent_loop.cli.config_file import read_config
    from agent_loop.cli.rollout import RolloutOptions

    keys = options_from(read_config(str(config), RolloutOptions), keys=True)
    assert keys.mcp_server == ["python a.py"] and keys.tools == "python" and keys.task == "arithmetic"


@pytest.mark.integration
def test_rollout_calls_a_real_mcp_servers_tools(tmp_path, tiny_agent_dir, capsys):
    """The tiny agent asks the calculator (here the MCP server's: only it is listed, as the tiny agent knows one
    calculator); its results are OBSERVATION spans of exact tokens."""
    prompts = tmp_path / "questions.jsonl"
    questions = [("What is 37*12+5?", 449), ("What is 8*9-3?", 69)]
    prompts.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in questions))
    out = tmp_path / "r.jsonl"
    code = main(["rollout", "--model", str(tiny_agent_dir), "--prompts", str(prompts), "--reward", "number",
                 "--mcp-server", f"python {EXAMPLE} --tools calculator", "--episodes", "2", "--temperature", "0", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    trajs = sorted(read_trajectories(out), key=lambda t: t.info["index"])
    for traj, (question, answer) in zip(trajs, questions):
        calls = [c for c in traj.tool_calls if c.name == "calculator"]
        assert calls and calls[0].error is None, traj.tool_calls
        assert calls[0].result == str(eval(calls[0].arguments["expression"]))  # the server's own arithmetic
        assert 2 in traj.spans and traj.metrics["template_exact"]


@pytest.mark.integration
@pytest.mark.parametrize("argv, words", [
    (["--mcp-server", f"{sys.executable} {REPO / 'tests/toolsets/mcp_test_server.py'} --no-tools"], "lists no tools"),
    (["--mcp-server", "no-such-mcp-command"], "did not start: FileNotFoundError"),
    (["--tools", "python", "--mcp-server", f"python {EXAMPLE} --tools calculator"], "'calculator' given twice"),
])
def test_rollout_refuses_unusable_tools_in_one_line(argv, words, tmp_path, tiny_agent_dir, capsys):
    code = main(["rollout", "--model", str(tiny_agent_dir), *argv, "--episodes", "1", "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.integration
def test_rollout_with_tools_python_adds_the_sandbox_to_a_task(tmp_path, tiny_agent_dir, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--model", str(tiny_agent_dir), "--task", "arithmetic", "--tools", "python",
                 "--episodes", "2", "--temperature", "0", "--out", str(out)]) == 0, capsys.readouterr().err
    trajs = read_trajectories(out)
    assert all(t.metrics["template_exact"] and t.finish_reason in ("stop", "max_turns") for t in trajs)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_agent_dir).decode(trajs[0].prompt_ids)
    assert '"name": "python"' in prompt and '"name": "calculator"' in prompt  # both tool sets in the template
