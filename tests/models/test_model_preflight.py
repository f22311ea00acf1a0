"""The preflight before any weights load (issue 36 item 6), on copies of the tiny agent with their weights
replaced by junk (loading them would fail with another error): a template that renders no tool calls is
refused in one line when the task has tools and fine when it has none; a tokenizer larger than the
config's vocabulary is refused in one line."""

import json
import shutil

import pytest

from agent_loop.cli import main
from agent_loop.model_folders import ModelError, check_model_dir

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOL_LESS_TASK = '''from agent_loop.types import Episode


class Greet:
    name = "greet"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "Say hi."}], tools=[])

    def reward(self, episode, messages, tool_calls):
        return float("hi" in messages[-1]["content"])
'''


def model_copy(tiny_agent_dir, folder, *, template=None, junk_weights=True, vocab_size=None):
    shutil.copytree(tiny_agent_dir, folder)
    if junk_weights:
        for weights in folder.glob("*.safetensors"):
            weights.write_bytes(b"junk")
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    if vocab_size is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    return folder


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize("command", ["rollout", "train", "warmstart"])
def test_a_template_without_tools_is_refused_before_weights_load(capsys, tmp_path, tiny_agent_dir, command):
    folder = model_copy(tiny_agent_dir, tmp_path / "m", template=CHATML)
    out = ["--out", str(tmp_path / "r.jsonl")] if command == "rollout" else ["--output-dir", str(tmp_path / "o")]
    code, err = run_cli(capsys, command, "--model", str(folder), "--task", "arithmetic", *out)
    assert code == 2 and f"--model {folder}: " in err
    assert "the chat template renders no tool schemas and no tool calls (a plain chat template?)" in err


def test_the_render_check_names_what_a_template_drops(tiny_agent_dir, tmp_path):
    """A template with the Hermes markers (a parser fits) that drops the calls fails (its results show as content)."""
    shows_schemas = ("{%- if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
                     "{{ '</tools> Call with <tool_call></tool_call><|im_end|>\\n' }}{% endif %}" + CHATML)
    with pytest.raises(ModelError, match=r"renders no tool calls \(a plain chat template\?\)"):
        check_model_dir(model_copy(tiny_agent_dir, tmp_path / "m", template=shows_schemas, junk_weights=False))


def test_a_tool_less_task_with_a_tool_less_template_plays(capsys, tmp_path, tiny_agent_dir):
    folder = model_copy(tiny_agent_dir, tmp_path / "m", template=CHATML, junk_weights=False)
    task = tmp_path / "greet.py"
    task.write_text(TOOL_LESS_TASK)
    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--model", str(folder), "--task", str(task), "--episodes", "2", "--max-tokens", "8",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    episodes = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(episodes) == 2 and all(e["finish_reason"] in ("stop", "length") for e in episodes)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(capsys, tmp_path, tiny_agent_dir):
    folder = model_copy(tiny_agent_dir, tmp_path / "m", vocab_size=100)
    code, err = run_cli(capsys, "rollout", "--model", str(folder), "--out", str(tmp_path / "r.jsonl"))
    assert code == 2 and "but config.json's vocab_size is 100 (ids past it have no embedding row)" in err
