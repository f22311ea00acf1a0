"""skyrl-gym environments through the loop (``--task skyrl_gym:ENV_ID --prompts ROWS``): each turn answered by
the environment's own step, checked against a serial replay of the same texts through a fresh instance of the
same environment (skyrl-gym's own step semantics: observations, rewards, done); tokens exact on the tiny
agent's real tokenizer and template; gsm8k, gsm8k_multi_turn, text2sql on a local SQLite file, lcb locally."""

import asyncio
import copy
import json
import sqlite3

import pytest
import skyrl_gym
from omegaconf import OmegaConf

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli.flags import UsageError, validate
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.tasks.plugins import PluginError
from agent_loop.tasks.registry import TaskOptions
from masking import SpanKind


def rows_file(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def task_of(spec, prompts, options=None):
    return validate(TaskOptions, {"task": spec, "prompts": prompts, "task_options": options or {}}).load()


def play(tokenizer, task, replies, index=0, max_turns=6):
    def script(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer.encode(replies[min(turn, len(replies) - 1)])

    config = LoopConfig(max_turns=max_turns, tool_timeout_s=60.0, max_tokens=512, max_response_tokens=4096,
                        max_observation_tokens=1024)
    return asyncio.run(run_episode(task, index, ScriptedBackend(script), tokenizer, config))


def replay(env_id, row, texts, env_config=None):
    """The serial reference: skyrl-gym's own env, made from the row as skyrl-train does, stepped on the texts."""
    extras = {k: copy.deepcopy(v) for k, v in row.items() if k not in ("prompt", "env_class")}
    env = skyrl_gym.make(env_id, env_config=OmegaConf.create(env_config or {}), extras=extras)
    env.init(copy.deepcopy(row["prompt"]))
    outputs = []
    for text in texts:
        outputs.append(env.step(text))
        if outputs[-1]["done"]:
            break
    env.close()
    return outputs


def assistant_texts(traj):
    return [m["content"] for m in traj.messages if m["role"] == "assistant"]


def assert_same_as_replay(traj, outputs, tokenizer):
    """Per-turn rewards, observations and done as the environment's own step gave them; tokens exact."""
    rewards = [o["reward"] for o in outputs]
    assert [s["reward"] for s in traj.info["steps"]] == rewards
    assert traj.reward + sum(traj.turn_rewards) == pytest.approx(sum(rewards))
    assert traj.reward == pytest.approx(rewards[-1])
    appended = [m for m in traj.messages if m["role"] == "user"][1:]  # after the prompt
    assert appended == [m for o in outputs if not o["done"] for m in o["observations"]]
    assert (traj.finish_reason == "stop") == outputs[-1]["done"]
    render = ChatFormatter(tokenizer).render(traj.messages)
    ids = traj.prompt_ids + traj.response_ids
    assert render[: len(ids)] == ids and traj.metrics["template_exact"]
    traj.check()


GSM8K = {"prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many "
                     "in total? End with '#### ANSWER'."}],
         "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {"split": "train"}}


def test_gsm8k_single_turn_reward_is_its_step(tiny_tokenizer, tmp_path):
    task = task_of("skyrl_gym:gsm8k", rows_file(tmp_path, [GSM8K, {**GSM8K, "reward_spec": {"ground_truth": "5"}}]))
    for index, reply in [(0, "48 + 24 = 72.\n#### 72"), (1, "#### 72"), (0, "I think 70.")]:
        traj = play(tiny_tokenizer, task, [reply], index=index)
        row = [GSM8K, {**GSM8K, "reward_spec": {"ground_truth": "5"}}][index]
        outputs = replay("gsm8k", row, assistant_texts(traj))
        assert assistant_texts(traj) == [reply] and len(outputs) == 1
        assert_same_as_replay(traj, outputs, tiny_tokenizer)
        assert traj.spans == [SpanKind.ASSISTANT] * len(traj.spans)
    assert play(tiny_tokenizer, task, ["#### 72"]).reward == 1.0  # the scorer really ran: a right answer scores


def test_gsm8k_multi_turn_observations_and_turn_rewards(tiny_tokenizer, tmp_path):
    row = {**GSM8K, "env_class": "gsm8k_multi_turn", "max_turns": 3}
    task = task_of("skyrl_gym:gsm8k_multi_turn", rows_file(tmp_path, [row]))
    replies = ["Let me think. #### 70", "Hmm, no answer here", "#### 72"]
    traj = play(tiny_tokenizer, task, replies)
    outputs = replay("gsm8k_multi_turn", row, assistant_texts(traj))
    assert assistant_texts(traj) == replies and len(outputs) == 3
    assert [o["reward"] for o in outputs] == [pytest.approx(0.2 / 3), 0.0, 1.0]
    assert_same_as_replay(traj, outputs, tiny_tokenizer)
    assert traj.turn_rewards == [pytest.approx(0.2 / 3), 0.0, 0.0] and traj.finish_reason == "stop"
    # the environment's feedback is an OBSERVATION span after each of the first two turns
    kinds = [s for i, s in enumerate(traj.spans) if i == 0 or traj.spans[i - 1] != s]
    assert kinds == [SpanKind.ASSISTANT, SpanKind.OBSERVATION] * 2 + [SpanKind.ASSISTANT]


def sqlite_db(root):
    folder = root / "spider" / "database" / "shop"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "shop.sqlite") as db:
        db.execute("CREATE TABLE items (name TEXT, price INTEGER)")
        db.executemany("INSERT INTO items VALUES (?, ?)", [("pen", 2), ("book", 12), ("lamp", 30)])
    return root


def test_text2sql_on_a_local_sqlite_file(tiny_tokenizer, tmp_path):
    db_root = sqlite_db(tmp_path / "sql")
    row = {"prompt": [{"role": "user", "content": "Which items cost more than 10? Table items(name, price)."}],
           "env_class": "text2sql", "db_id": "shop", "data": "spider", "max_turns": 3,
           "reward_spec": {"method": "rule", "ground_truth": "SELECT name FROM items WHERE price > 10"}}
    options = {"db_path": str(db_root)}
    task = task_of("skyrl_gym:text2sql", rows_file(tmp_path, [row]), options)
    replies = ["<think>Look first.</think>\n<sql>SELECT name, price FROM items</sql>",
               "<think>book and lamp.</think>\n<solution>SELECT name FROM items WHERE price >= 12</solution>"]
    traj = play(tiny_tokenizer, task, replies)
    outputs = replay("text2sql", row, assistant_texts(traj), options)
    assert len(outputs) == 2 and "lamp" in outputs[0]["observations"][0]["content"]  # the query ran on the file
    assert outputs[-1]["reward"] == 1.0 and outputs[-1]["done"]
    assert_same_as_replay(traj, outputs, tiny_tokenizer)
    wrong = play(tiny_tokenizer, task, ["<think>.</think><solution>SELECT name FROM items</solution>"])
    assert wrong.reward == replay("text2sql", row, assistant_texts(wrong), options)[-1]["reward"] == 0.0


def test_lcb_runs_its_code_locally(tiny_tokenizer, tmp_path):
    tests = [{"input": "3\n", "output": "9\n", "testtype": "stdin"}, {"input": "5\n", "output": "25\n", "testtype": "stdin"}]
    row = {"prompt": [{"role": "user", "content": "Read n, print n squared."}], "env_class": "lcb",
           "reward_spec": {"method": "rule", "ground_truth": json.dumps(tests)}}
    task = task_of("skyrl_gym:lcb", rows_file(tmp_path, [row]))
    for reply, expected in [("```python\nn = int(input())\nprint(n * n)\n```", 1.0),
                            ("```python\nn = int(input())\nprint(n + n)\n```", 0.0)]:
        traj = play(tiny_tokenizer, task, [reply])
        outputs = replay("lcb", row, assistant_texts(traj))
        assert outputs[0]["reward"] == expected
        assert_same_as_replay(traj, outputs, tiny_tokenizer)


@pytest.mark.parametrize("spec, options, message", [
    ("skyrl_gym:gsm8", None, "no skyrl_gym task 'gsm8'; did you mean gsm8k?"),
    ("skyrl_gym:search", None, "needs a retrieval server over the network"),
    ("skyrl_gym:text2sql", {"db_path": "/nonexistent"}, "row 0"),
])
def test_bad_environments_are_one_line(tmp_path, spec, options, message):
    row = {**GSM8K, "db_id": "shop", "data": "spider"}
    with pytest.raises((UsageError, PluginError)) as error:
        task_of(spec, rows_file(tmp_path, [row]), options)
    assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UsageError, match="plays rows: give --prompts ROWS"):
        validate(TaskOptions, {"task": "skyrl_gym:gsm8k"})
