"""reasoning-gym datasets as tasks (``--task reasoning_gym:NAME``): entry i is episode i, the reward is the
dataset's own score_answer on the final answer, tools optional, composite, bad names and options; the tiny
agent's real tokenizer and template, scripted replies for the loop logic and the real tiny agent through the CLI."""

import asyncio
import json

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli import main
from agent_loop.cli.flags import UsageError, validate
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import ToolExecutor
from agent_loop.runners.local import read_trajectories
from agent_loop.tasks.plugins import PluginError
from agent_loop.tasks.registry import TaskOptions, load_task
from masking import SpanKind


def task_of(spec, options=""):
    return validate(TaskOptions, {"task": spec, "task_options": options}).load()


def play(tokenizer, task, replies, index=0):
    def script(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer.encode(replies[min(turn, len(replies) - 1)])

    return asyncio.run(run_episode(task, index, ScriptedBackend(script), tokenizer, LoopConfig(max_turns=3)))


def assert_exact(traj, tokenizer, tools=()):
    render = ChatFormatter(tokenizer, tools=ToolExecutor(list(tools)).schemas).render(traj.messages)
    ids = traj.prompt_ids + traj.response_ids
    assert render[: len(ids)] == ids and tokenizer.decode(render[len(ids):]).strip() == ""
    assert traj.metrics["template_exact"]


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum"])
def test_entry_i_is_episode_i_and_scored_by_the_dataset(tiny_tokenizer, name):
    task = task_of(f"reasoning_gym:{name}", "size=5,seed=3")
    reference = reasoning_gym.create_dataset(name, size=5, seed=3)
    for index in (0, 4):
        entry = reference[index]
        right = play(tiny_tokenizer, task, [f"Thinking.\n<answer>{entry['answer']}</answer>"], index=index)
        assert right.messages[-2]["content"] == entry["question"] and right.info["entry"] == index
        assert right.messages[0]["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["default"]
        assert right.reward == reference.score_answer(entry["answer"], entry) == 1.0 and right.info["success"]
        assert_exact(right, tiny_tokenizer)
        wrong = play(tiny_tokenizer, task, ["<answer>123456789</answer>"], index=index)
        assert wrong.reward == reference.score_answer("123456789", entry) < 1.0
        untagged = play(tiny_tokenizer, task, [f"It is {entry['answer']}."], index=index)
        assert untagged.reward == reference.score_answer(None, entry) == 0.0  # reasoning-gym's own convention
    with pytest.raises(ValueError, match="episode index 5 is past the dataset's 5 entries"):
        task.make_episode(5)


def test_text_answers_generator_config_and_calculator(tiny_tokenizer):
    task = task_of("reasoning_gym:chain_sum", {"size": 3, "seed": 1, "min_terms": 4, "max_terms": 4,
                                               "answer": "text", "calculator": True, "system": ""})
    entry = reasoning_gym.create_dataset("chain_sum", size=3, seed=1, min_terms=4, max_terms=4)[2]
    assert entry["metadata"]["num_terms"] == 4
    expression = entry["metadata"]["expression"]
    call = '<tool_call>\n' + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + '\n</tool_call>'
    traj = play(tiny_tokenizer, task, [call, f"{entry['answer']}"], index=2)
    assert traj.messages[0]["role"] == "user"  # system "" -> none
    assert traj.tool_calls[0].result == entry["answer"] and traj.reward == 1.0
    assert SpanKind.OBSERVATION in traj.spans
    assert_exact(traj, tiny_tokenizer, task.tools)


def test_composite_of_several_datasets(tiny_tokenizer):
    datasets = [{"name": "chain_sum", "weight": 1, "config": {}}, {"name": "basic_arithmetic", "weight": 1}]
    task = task_of("reasoning_gym:composite", {"size": 6, "seed": 2, "datasets": datasets})
    from reasoning_gym.composite import DatasetSpec

    reference = reasoning_gym.create_dataset("composite", size=6, seed=2, datasets=[
        DatasetSpec("chain_sum", 1.0, {}), DatasetSpec("basic_arithmetic", 1.0, {})])
    sources = set()
    for index in range(6):
        entry = reference[index]
        sources.add(entry["metadata"]["source_dataset"])
        traj = play(tiny_tokenizer, task, [f"<answer>{entry['answer']}</answer>"], index=index)
        assert traj.reward == reference.score_answer(extract_answer(f"<answer>{entry['answer']}</answer>"), entry) == 1.0
    assert sources == {"chain_sum", "basic_arithmetic"}


@pytest.mark.parametrize("spec, options, message", [
    ("reasoning_gym:chain_sums", "", "no reasoning_gym task 'chain_sums'; did you mean chain_sum?"),
    ("reasoning_gym:chain_sum", "bogus=1", "no option 'bogus'; its generator takes allow_negation"),
    ("reasoning_gym:chain_sum", "min_terms=5,max_terms=2", "the generator refused its options: AssertionError"),
    ("reasoning_gym:composite", {"datasets": [{"name": "chian_sum"}]}, "unknown dataset 'chian_sum'; did you mean"),
    ("reasoning_gym:chain_sum", "answer=last", "answer='last': must be one of tag, text"),
])
def test_bad_names_and_options_are_one_line(spec, options, message):
    with pytest.raises((UsageError, PluginError)) as error:
        task_of(spec, options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_load_task_takes_a_source_spec_with_default_options():
    task = load_task("reasoning_gym:basic_arithmetic")
    assert task.name == "reasoning_gym:basic_arithmetic" and task.size == 500 and task.tools == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum"])
def test_rollout_command_as_written(tiny_agent_dir, tmp_path, name):
    """``agent-loop rollout --task reasoning_gym:NAME --episodes 8`` with the tiny agent: 8 entries, each scored by
    the dataset's own score_answer on the recorded final answer, tokens exact."""
    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--task", f"reasoning_gym:{name}", "--episodes", "8", "--model", str(tiny_agent_dir),
                 "--out", str(out)]) == 0
    records = sorted(read_trajectories(out), key=lambda t: t.info["index"])
    reference = reasoning_gym.create_dataset(name, size=500, seed=0)
    assert [t.info["entry"] for t in records] == list(range(8))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir)
    for traj in records:
        entry = reference[traj.info["entry"]]
        assert traj.messages[1] == {"role": "user", "content": entry["question"]}
        last = [m for m in traj.messages if m["role"] == "assistant"][-1]
        final = "" if last.get("tool_calls") or "<tool_call>" in last["content"] else last["content"]
        assert traj.reward == reference.score_answer(extract_answer(final) if final else None, entry)
        assert traj.metrics["template_exact"]
        if traj.finish_reason == "stop":  # a sampled tokenization need not be the canonical one: compare text
            text = tokenizer.decode(traj.prompt_ids + traj.response_ids)
            render = ChatFormatter(tokenizer).render_text(traj.messages)
            assert render.startswith(text) and render[len(text):].strip() == ""
