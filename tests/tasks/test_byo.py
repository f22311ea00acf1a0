"""Bring your own task, tools, prompts, rewards and config (agent_loop.tasks, agent_loop.cli.config_file, models).

The loop runs here with the real Qwen2.5 tokenizer and template and a scripted generator (loop logic);
tests/backends/test_architectures.py runs real random-weight models of real architectures.
"""

import asyncio
import json
import textwrap

import pytest
import yaml

import agent_loop
from agent_loop import DatasetTask, Environment, tool, tools_from_schemas
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli.config_file import ConfigError, read_config
from agent_loop.cli.rollout import RolloutOptions
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.dataset import load_prompts
from agent_loop.tasks.plugins import PluginError, load_reward, load_tools
from agent_loop.tasks.registry import TaskOptions, load_task
from agent_loop.tasks.rewards import get_rule


def task_from_options(**options):
    return TaskOptions(**options).load()


def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: The string to reverse.
    """
    return text[::-1]


def play(task, tokenizer, replies, episodes=2, **config):
    """Run ``task`` with a scripted model: at its k-th assistant turn an episode gets ``replies[k]``
    (the last one after that), or ``replies(prompt_text, k)`` if ``replies`` is a function."""

    def script(prompt):
        text = tokenizer.decode(prompt)
        turn = text.count("<|im_start|>assistant") - 1
        reply = replies(text, turn) if callable(replies) else replies[min(turn, len(replies) - 1)]
        return tokenizer.encode(reply, add_special_tokens=False)

    return asyncio.run(run_rollouts(task, ScriptedBackend(script), tokenizer, range(episodes),
                                    LoopConfig(**config), progress=False))


# --- the public API and the custom-task example ---------------------------------------------------


def test_public_api_names_resolve_and_unknown_names_fail():
    for name in agent_loop.__all__:
        assert getattr(agent_loop, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        agent_loop.Nope


def test_the_example_custom_task_is_short_and_plays_through_the_loop(qwen_tokenizer):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "custom_task.py"
    code = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(code) <= 25
    task = load_task(f"{path}:Reverse")
    assert task.name == "Reverse"
    episode = task.make_episode(3, seed=1)
    assert episode.messages[0]["content"].startswith("Reverse the word ")
    word = episode.messages[0]["content"].removeprefix("Reverse the word ").rstrip(".")
    assert episode.answer == word[::-1] and task.make_episode(3, seed=1).answer == episode.answer

    def model(prompt, turn):  # a scripted model that uses the tool, then copies its result
        if turn == 0:
            word = prompt.split("Reverse the word ")[1].split(".")[0]
            return '<tool_call>\n{"name": "reverse", "arguments": {"text": "%s"}}\n</tool_call>' % word
        return "It is " + prompt.split("<tool_response>\n")[1].split("\n</tool_response>")[0] + "."

    trajectories = play(task, qwen_tokenizer, model, episodes=3)
    for i, t in enumerate(trajectories):
        assert t.info["answer"] == task.make_episode(i).answer and t.info["index"] == i
        assert t.tool_calls[0].result == t.info["answer"] and t.tool_calls[0].error is None
        assert t.reward == 1.0 and t.success and t.finish_reason == "stop"


# --- rows from data ---------------------------------------------------------------------------------


def test_jsonl_with_bad_lines_keeps_the_good_ones_and_names_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "What is 2+2?", "answer": 4, "level": "easy"}),
        "{not json",
        json.dumps({"question": "no prompt field"}),
        "",
        json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
        json.dumps({"prompt": [{"role": "robot", "content": "x"}]}),
    ]) + "\n")
    with pytest.warns(UserWarning, match="3 bad prompt rows skipped"):
        task = DatasetTask(path, reward="number")
    assert len(task) == 2
    assert [s.split(": ")[0] for s in task.skipped] == [f"{path}:2", f"{path}:3", f"{path}:6"]
    assert "not JSON" in task.skipped[0] and "no 'prompt' field" in task.skipped[1] and "robot" in task.skipped[2]
    first = task.make_episode(0)
    assert first.messages == [{"role": "user", "content": "What is 2+2?"}] and first.answer == 4
    assert first.info["row"] == {"level": "easy"}
    assert task.make_episode(1).messages[0] == {"role": "system", "content": "Be brief."}
    assert task.make_episode(2).answer == 4  # wraps around


def test_a_json_file_holding_one_array_gives_its_rows(tmp_path):
    """A .json file is often one (pretty-printed) JSON array: its elements are the rows, bad ones named by place;
    a .json file of lines still reads a line at a time; a broken array is one error naming line and column."""
    rows = [{"prompt": "What is 2+2?", "answer": 4}, {"question": "no prompt"}, {"prompt": "Hi", "answer": "x"}]
    array = tmp_path / "prompts.json"
    array.write_text("\ufeff  " + json.dumps(rows, indent=2), encoding="utf-8")  # a BOM and spaces before it
    with pytest.warns(UserWarning, match="1 bad prompt row skipped"):
        task = DatasetTask(array, reward="number")
    assert [r["answer"] for r in task.rows] == [4, "x"] and task.skipped == [f"{array}:row 1: no 'prompt' field (keys: question)"]
    lines = tmp_path / "lines.json"
    lines.write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in rows[::2]), encoding="utf-8")
    assert load_prompts(lines)[0] == task.rows
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"broken.json: a JSON array that is not JSON \(Expecting value at line 2 column"):
        load_prompts(broken)


def test_a_file_without_any_good_row_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match=f"no usable prompt in {path}: {path}:1: not JSON"):
        load_prompts(path)
    with pytest.raises(ValueError, match="prompts file not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_parquet_and_hf_dataset_on_disk_give_the_same_rows_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    records = [{"prompt": f"q{i}", "answer": str(i), "source": "unit"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    DatasetDict({"train": Dataset.from_list(records), "test": Dataset.from_list(records[:2])}).save_to_disk(tmp_path / "ds")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected, _ = load_prompts(jsonl)
    assert load_prompts(tmp_path / "p.parquet")[0] == expected
    assert load_prompts(tmp_path / "ds")[0] == expected  # the "train" split by default
    assert len(load_prompts(tmp_path / "ds", split="test")[0]) == 2
    assert load_prompts(Dataset.from_list(records))[0] == expected


def test_verl_parquet_layout_prompt_messages_and_ground_truth(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2+3?"}],
           "reward_model": {"style": "rule", "ground_truth": "5"}}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "train.parquet")
    task = DatasetTask(tmp_path / "train.parquet", reward="number")
    episode = task.make_episode(0)
    assert episode.messages == [{"role": "user", "content": "2+3?"}] and episode.answer == "5"
    assert episode.info["row"]["data_source"] == "gsm8k"


def test_shuffle_visits_every_row_once_per_pass_and_replays():
    task = DatasetTask([f"q{i}" for i in range(10)], reward="exact", shuffle=True)
    first_pass = [task.row_index(i, seed=3) for i in range(10)]
    assert sorted(first_pass) == list(range(10)) and first_pass != list(range(10))
    assert sorted(task.row_index(i, seed=3) for i in range(10, 20)) == list(range(10))
    assert [task.row_index(i, seed=3) for i in range(10)] == first_pass


# --- rewards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule,completion,answer,expected", [
    ("exact", "  cba \n", "cba", 1.0), ("exact", "It is cba", "cba", 0.0),
    ("contains", "It is cba.", "cba", 1.0), ("contains", "It is abc.", "cba", 0.0),
    ("number", "so 12, then 449.", 449, 1.0), ("number", "449 or 450", 449, 0.0), ("number", "none", "3", 0.0),
    (r"regex:\\boxed\{(.*?)\}", r"x \boxed{7} and \boxed{8}", "8", 1.0),
    (r"regex:\\boxed\{(.*?)\}", r"x \boxed{7}", "8", 0.0),
    (r"regex:^<answer>", "<answer>x", None, 1.0),
])
def test_built_in_rules(rule, completion, answer, expected):
    assert get_rule(rule)(completion=completion, answer=answer) == expected


def test_unknown_rule_names_the_rules():
    with pytest.raises(ValueError, match="unknown reward rule 'exactly'.*exact, contains, number, regex:PATTERN"):
        get_rule("exactly")


def test_weighted_rewards_by_argument_name_and_parts_recorded(qwen_tokenizer):
    def brevity(completion):
        return 1.0 if len(completion) < 20 else 0.0

    def used_tool(tool_calls, row):
        return float(any(c.error is None for c in tool_calls)) * row["bonus"]

    task = DatasetTask([{"prompt": "Reverse abc.", "answer": "cba", "bonus": 2}], reward=["exact", brevity, used_tool],
                       reward_weights=[1.0, 0.5, 0.25], tools=[reverse])
    call = '<tool_call>\n{"name": "reverse", "arguments": {"text": "abc"}}\n</tool_call>'
    [t] = play(task, qwen_tokenizer, [call, "cba"], episodes=1)
    assert t.info["rewards"] == {"exact_match": 1.0, "brevity": 1.0, "used_tool": 2.0}
    assert t.reward == pytest.approx(1.0 + 0.5 + 0.25 * 2.0)
    [t] = play(task, qwen_tokenizer, ["I do not know the answer at all"], episodes=1)
    assert t.info["rewards"] == {"exact_match": 0.0, "brevity": 0.0, "used_tool": 0.0} and t.reward == 0.0


def test_a_final_turn_that_still_calls_a_tool_is_no_answer(qwen_tokenizer):
    task = DatasetTask([{"prompt": "Reverse abc.", "answer": "cba"}], reward="contains", tools=[reverse])
    call = '<tool_call>\n{"name": "reverse", "arguments": {"text": "cba"}}\n</tool_call>'
    [t] = play(task, qwen_tokenizer, [call], episodes=1, max_turns=1)
    assert t.finish_reason == "max_turns" and t.reward == 0.0  # "cba" is in the call, not in an answer


def test_a_malformed_calls_record_has_no_name_and_the_raw_text_as_documented(qwen_tokenizer):
    """Issue 40 item 13: the record of a call the parser could not read has ``name == ""``, ``arguments`` the raw
    text and error kind ``malformed_json``, as docs/python_api.md's table of reward arguments says; a read call
    has its name and a dict."""
    from pathlib import Path

    broken = '{"name": "reverse", "arguments": {"text": "abc"},}'
    replies = [f"<tool_call>\n{broken}\n</tool_call>", '<tool_call>\n{"name": "reverse", "arguments": '
               '{"text": "abc"}}\n</tool_call>', "cba"]
    [t] = play(DatasetTask([{"prompt": "Reverse abc.", "answer": "cba"}], reward="exact", tools=[reverse]),
               qwen_tokenizer, replies, episodes=1, max_turns=3)
    bad, good = t.tool_calls
    assert (bad.name, bad.error_kind, bad.turn) == ("", "malformed_json", 0) and isinstance(bad.arguments, str)
    assert broken in bad.arguments and bad.result is None and bad.error
    assert (good.name, good.arguments, good.error_kind) == ("reverse", {"text": "abc"}, None)
    doc = (Path(__file__).parents[2] / "docs" / "python_api.md").read_text()
    assert 'a malformed call (one the parser could not read) has `name == ""`, `arguments` the raw text' in doc


def test_a_reward_that_raises_is_an_error_episode_and_the_run_goes_on(qwen_tokenizer):
    """A reward function that raises (or returns a non-number) ends that episode with finish "error", reward 0 and
    the message, its tokens kept (a training step drops it); the other episodes and their rewards are untouched."""
    def fragile(completion, answer):
        if completion == "boom":
            raise KeyError("missing")
        return 1.0

    def not_a_number(completion):
        return "yes"

    task = DatasetTask(["a", "b"], reward=["exact", fragile])
    trajectories = play(task, qwen_tokenizer, ["boom"], episodes=2)
    assert [t.finish_reason for t in trajectories] == ["error", "error"] and [t.reward for t in trajectories] == [0.0, 0.0]
    # the place in the user's code it raised from: this file, the line of the raise (issue 40 item 10)
    where = f"{__file__}:{fragile.__code__.co_firstlineno + 2}"
    message = f"RewardError: reward function 'fragile' raised KeyError: 'missing' (at {where})"
    assert all(t.info["reward_error"] == t.metrics["error"] == message for t in trajectories)
    assert not any(t.success for t in trajectories) and "rewards" not in trajectories[0].info  # no partial sum
    assert qwen_tokenizer.decode(trajectories[0].response_ids).startswith("boom")  # the played turn is kept
    [t] = play(DatasetTask(["a"], reward=not_a_number), qwen_tokenizer, ["ok"], episodes=1)
    assert t.finish_reason == "error" and t.reward == 0.0
    # as_reward's own error: no frame of the user's code raised it, so no place is named
    assert t.info["reward_error"] == "RewardError: reward function 'not_a_number' raised TypeError: returned str 'yes', not a number"
    [t] = play(DatasetTask(["a"], reward=fragile), qwen_tokenizer, ["fine"], episodes=1)
    assert t.finish_reason == "stop" and t.reward == 1.0 and "reward_error" not in t.info and "error" not in t.metrics

    def some(completion, row):  # raises for one row in two: the others keep their reward
        if row["bad"]:
            raise ValueError("bad row")
        return 0.5

    got = play(DatasetTask([{"prompt": "x", "bad": i % 2 == 1} for i in range(4)], reward=some), qwen_tokenizer,
               ["fine"], episodes=4)
    assert [t.finish_reason for t in got] == ["stop", "error", "stop", "error"]
    assert [t.reward for t in got] == [0.5, 0.0, 0.5, 0.0]


def test_sample_gets_the_episode_index_so_n_episodes_cover_n_prompts():
    """``sample(rng, index)`` gets the episode's index (issue 40 item 4): 6 episodes of 6 rows cover all 6, the
    same index gives the same row at any seed; ``sample(rng)`` keeps working, and a parameter it could not be
    given is refused when the class is defined."""
    rows = [f"question {k}" for k in range(6)]

    class Covering(Environment):
        def sample(self, rng, index):
            return {"prompt": rows[index % len(rows)], "answer": str(index % len(rows))}

        def score(self, completion, answer):
            return 0.0

    class ByKeyword(Covering):  # an override taking **kwargs is given index too
        def sample(self, rng, **options):
            return rows[options["index"] % len(rows)]

    class Old(Environment):
        def sample(self, rng):
            return rows[rng.randrange(len(rows))]

        def score(self, completion):
            return 0.0

    for task in (Covering(), ByKeyword()):
        prompts = [task.make_episode(i, seed=s).messages[-1]["content"] for s in (0, 7) for i in range(6)]
        assert prompts == rows + rows
    old = [Old().make_episode(i).messages[-1]["content"] for i in range(6)]
    assert old == [Old().make_episode(i).messages[-1]["content"] for i in range(6)] and set(old) <= set(rows)
    with pytest.raises(TypeError, match=r"Bad.sample: cannot pass its parameter 'split'"):
        class Bad(Environment):
            def sample(self, rng, split):
                return "x"


def test_numpy_answers_and_metadata_stay_numbers_and_lists(qwen_tokenizer):
    """The probe: an Environment whose sample held numpy values wrote answer "8" (a string) and an array as
    "[0. 1. 2.]"; numpy scalars and arrays become their JSON values (and rewards see those)."""
    import numpy as np

    seen = []

    class NumpyAnswers(Environment):
        def sample(self, rng):
            return {"prompt": "What is 4+4?", "answer": np.int64(8), "weights": np.arange(3, dtype=np.float32),
                    "scale": np.float64(0.5)}

        def score(self, completion, answer, row):
            seen.append((answer, row))
            return float(str(answer) in completion)

    [t] = play(NumpyAnswers(), qwen_tokenizer, ["It is 8."], episodes=1)
    assert t.reward == 1.0 and seen == [(8, {"weights": [0.0, 1.0, 2.0], "scale": 0.5})]
    assert type(seen[0][0]) is int
    line = json.loads(t.to_json())
    assert line["info"]["answer"] == 8 and line["info"]["row"] == {"weights": [0.0, 1.0, 2.0], "scale": 0.5}
    assert "json_repairs" not in line["metrics"]
    task = DatasetTask([{"prompt": "a", "answer": np.float32(0.25), "ids": np.array([[1, 2]])}], reward="number")
    assert task.rows[0]["answer"] == 0.25 and task.rows[0]["row"] == {"ids": [[1, 2]]}


def test_a_reward_with_a_parameter_we_cannot_pass_is_an_error_at_once():
    def bad(completion, gold):
        return 0.0

    with pytest.raises(TypeError, match="reward function 'bad': cannot pass its parameter 'gold'; it may take any of completion"):
        DatasetTask(["a"], reward=bad)
    with pytest.raises(ValueError, match="2 reward_weights for 1 reward functions"):
        DatasetTask(["a"], reward="exact", reward_weights=[1, 2])


def test_per_turn_rewards_reach_the_batch_tensors(qwen_tokenizer):
    from agent_loop.runners.batch import trajectories_to_batch
    from masking.spans import SpanKind

    def turn_reward(turn, tool_calls):
        return 0.1 * len([c for c in tool_calls if c.error is None]) - 0.01 * turn

    task = DatasetTask([{"prompt": "Reverse abc.", "answer": "cba"}], reward="exact", tools=[reverse], turn_reward=turn_reward)
    call = '<tool_call>\n{"name": "reverse", "arguments": {"text": "abc"}}\n</tool_call>'
    [t] = play(task, qwen_tokenizer, [call, "cba"], episodes=1)
    assert t.turn_rewards == pytest.approx([0.1, -0.01]) and t.reward == 1.0
    batch = trajectories_to_batch([t], pad_token_id=qwen_tokenizer.pad_token_id)
    rewards, spans, turns = batch["token_level_rewards"][0], batch["spans"][0], batch["turn_ids"][0]
    last_of_turn0 = max(i for i in range(len(spans)) if spans[i] == SpanKind.ASSISTANT and turns[i] == 0)
    assert rewards[last_of_turn0].item() == pytest.approx(0.1)
    assert rewards.sum().item() == pytest.approx(1.0 + 0.1 - 0.01)


def test_a_reward_error_names_the_users_line_not_the_librarys(tmp_path):
    """An error raised inside Python's library (json) from a user's reward file names the user's line that called it."""
    import json as json_module

    from agent_loop.tasks.rewards import RewardError, reward_terms, score_episode
    from agent_loop.types import Episode

    user = tmp_path / "my_reward.py"
    user.write_text("import json\n\ndef score(completion):\n    return json.loads(completion)['year_published']\n")
    namespace: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)
    episode = Episode(messages=[{"role": "user", "content": "q"}], tools=[])
    for text, kind in (("not json", json_module.JSONDecodeError.__name__), ("{}", "KeyError")):
        with pytest.raises(RewardError) as raised:
            score_episode(reward_terms(namespace["score"]), episode, [{"role": "assistant", "content": text}], [])
        assert str(raised.value).startswith(f"reward function 'score' raised {kind}")
        assert str(raised.value).endswith(f"(at {user}:4)")


def test_a_turn_reward_that_raises_is_an_error_episode_too(qwen_tokenizer):
    def broken(message):
        raise RuntimeError("nope")

    [t] = play(DatasetTask([{"prompt": "a", "answer": "a"}], reward="exact", turn_reward=broken), qwen_tokenizer, ["a"], episodes=1)
    assert t.finish_reason == "error" and t.reward == 0.0 and t.turn_rewards is None
    where = f"{__file__}:{broken.__code__.co_firstlineno + 1}"
    assert t.info["reward_error"] == f"RewardError: turn reward 'broken' raised RuntimeError: nope (at {where})"


# --- tools --------------------------------------------------------------------------------------------


def test_tool_decorator_checks_the_schema_at_definition():
    assert tool(reverse) is reverse

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(TypeError, match="tool '.*undocumented'"):
        tool(undocumented)
    with pytest.raises(TypeError, match="undocumented"):
        class Bad(Environment):
            tools = [undocumented]


def test_mcp_style_schemas_with_a_handler_are_what_the_model_sees_and_validated(qwen_tokenizer):
    from agent_loop.episode.parsers import ParsedCall
    from agent_loop.episode.tools import ToolExecutor

    schemas = [{"name": "weather", "description": "Weather of a city.",
                "inputSchema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                                "required": ["city"]}},
               {"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": {"type": "object", "properties": {}}}}]
    seen = []

    async def call_tool(name, arguments):
        seen.append((name, arguments))
        return {"city": arguments.get("city"), "sky": "clear"}

    tools = tools_from_schemas(schemas, call_tool)
    executor = ToolExecutor(tools)
    assert executor.schemas[0]["function"]["parameters"]["properties"]["city"]["enum"] == ["Paris", "Oslo"]
    records = asyncio.run(executor.execute([ParsedCall("weather", {"city": "Oslo"}), ParsedCall("weather", {"city": "Rome"}),
                                            ParsedCall("ping", {})]))
    assert json.loads(records[0].result) == {"city": "Oslo", "sky": "clear"}
    assert records[1].error_kind == "invalid_arguments" and "Rome" in records[1].error
    assert records[2].error is None and seen == [("weather", {"city": "Oslo"}), ("ping", {})]
    rendered = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=executor.schemas, tokenize=False)
    assert "Weather of a city." in rendered and '"enum": ["Paris", "Oslo"]' in rendered
    with pytest.raises(ValueError, match="'weather' has a schema but no implementation"):
        tools_from_schemas(schemas, {"ping": lambda: "pong"})


def test_tools_module_functions_list_and_schemas(tmp_path):
    (tmp_path / "mytools.py").write_text(textwrap.dedent('''
        from json import dumps  # imported names are not tools

        def shout(text: str) -> str:
            """Upper-case a text.

            Args:
                text: The text.
            """
            return text.upper()

        def _helper():
            pass
    '''))
    (tmp_path / "mcp_tools.py").write_text(textwrap.dedent('''
        TOOL_SCHEMAS = [{"name": "add", "description": "Add.", "inputSchema": {"type": "object",
                         "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]

        def call_tool(name, arguments):
            return arguments["a"] + arguments["b"]
    '''))
    (tmp_path / "empty_tools.py").write_text("X = 1\n")
    [shout] = load_tools(str(tmp_path / "mytools.py"))
    assert shout("a") == "A"
    [add] = load_tools(str(tmp_path / "mcp_tools.py"))
    assert add(a=2, b=3) == 5 and add.json_schema["function"]["name"] == "add"
    with pytest.raises(PluginError, match="defines no tool"):
        load_tools(str(tmp_path / "empty_tools.py"))


# --- plug-ins ---------------------------------------------------------------------------------------


def test_task_paths_that_do_not_import_say_why(tmp_path):
    with pytest.raises(PluginError, match="--task 'no_such_pkg.tasks:T' does not import: No module named 'no_such_pkg'"):
        load_task("no_such_pkg.tasks:T")
    broken = tmp_path / "broken_task.py"
    broken.write_text("import math\nraise RuntimeError('half-written task')\n")
    with pytest.raises(PluginError, match="does not import: RuntimeError: half-written task"):
        load_task(str(broken))
    with pytest.raises(PluginError, match="file not found"):
        load_task(str(tmp_path / "nothing.py"))
    with pytest.raises(PluginError, match="no 'ArithmeticTsk' in agent_loop.tasks.builtin; did you mean 'ArithmeticTask'"):
        load_task("agent_loop.tasks.builtin:ArithmeticTsk")
    with pytest.raises(PluginError, match="not a built-in task.*did you mean 'arithmetic'"):
        load_task("arithmetc")
    with pytest.raises(PluginError, match="'agent_loop.tasks.builtin:LOOKUP_KEYS' is not a task: a task has make_episode"):
        load_task("agent_loop.tasks.builtin:LOOKUP_KEYS")
    with pytest.raises(PluginError, match=r"calling calculator\(\) raised TypeError"):
        load_task("agent_loop.tasks.builtin:calculator")


def test_a_task_file_imports_its_neighbours_and_a_misspelled_name_gets_a_hint(tmp_path, monkeypatch):
    folder = tmp_path / "units"
    folder.mkdir()
    (folder / "units_tools.py").write_text("def to_metres(feet: float) -> float:\n    return feet * 0.3048\n")
    (folder / "units_task.py").write_text(textwrap.dedent('''
        from units_tools import to_metres
        from agent_loop import Environment

        class UnitConvert(Environment):
            def sample(self, rng):
                return f"{to_metres(10):.3f}"

            def score(self, completion, row):
                return 1.0
    '''))
    (folder / "lost_task.py").write_text("import units_toolz\n")
    monkeypatch.chdir(tmp_path)  # not the file's folder: the import must not depend on where one stands
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    task = load_task("units/units_task.py:UnitConvert")
    assert task.make_episode(0).messages[-1]["content"] == "3.048"
    with pytest.raises(PluginError, match="no 'UnitConvrt' in units/units_task.py; did you mean 'UnitConvert'"):
        load_task("units/units_task.py:UnitConvrt")
    with pytest.raises(PluginError, match="'units_toolz' is neither installed nor a module beside lost_task.py"):
        load_task("units/lost_task.py")


def test_task_from_a_module_class_object_or_file(tmp_path):
    assert load_task("agent_loop.tasks.builtin:LookupTask").name == "lookup"
    assert load_task("arithmetic").name == "arithmetic"
    path = tmp_path / "my_task.py"
    path.write_text(textwrap.dedent('''
        from agent_loop import Environment

        class Echo(Environment):
            def sample(self, rng):
                return f"say {rng.randint(0, 9)}"

            def score(self, completion, row):
                return 1.0
    '''))
    task = load_task(str(path))
    assert task.name == "Echo" and task.make_episode(0).messages[0]["content"].startswith("say ")


def test_options_that_do_not_go_together(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="^tools apply to a task from prompts FILE"):
        task_from_options(task="arithmetic", tools="x")
    with pytest.raises(ValueError, match="either task or prompts"):
        task_from_options(task="lookup", prompts=str(prompts), reward=["exact"])
    with pytest.raises(ValueError, match="prompts needs a reward"):
        task_from_options(prompts=str(prompts))
    with pytest.raises(PluginError, match="--reward 'agent_loop.tasks.builtin:nope': no 'nope' in agent_loop.tasks.builtin"):
        load_reward("agent_loop.tasks.builtin:nope")
    task = task_from_options(prompts=str(prompts), reward=["exact", "agent_loop.tasks.builtin:answer_reward"])
    assert task.name == "p" and [r[0] for r in task.rewards] == ["exact_match", "answer_reward"]


# --- config file ------------------------------------------------------------------------------------


def test_config_unknown_key_names_it_and_the_closest_valid_key(tmp_path, capsys):
    from agent_loop.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("episodes: 4\nmax_turn: 3\n")
    assert main(["rollout", "--config", str(config), "--out", str(tmp_path / "r.jsonl")]) == 2
    assert "unknown key 'max_turn'; did you mean 'max_turns'?" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()  # nothing written before the settings are checked


def test_config_flags_override_the_file_lists_included(tmp_path):
    from agent_loop.cli import build_parser
    from agent_loop.cli.flags import resolve

    path = tmp_path / "run.yaml"
    path.write_text("prompts: p.jsonl\nreward: [number, exact]\nmax_turns: 2\ntemperature: 0.5\n")
    parse = build_parser().parse_args
    opts = resolve(RolloutOptions, parse(["rollout", "--config", str(path), "--reward", "contains", "--max-turns", "5"]))
    assert (opts.reward, opts.max_turns, opts.temperature) == (["contains"], 5, 0.5)
    opts = resolve(RolloutOptions, parse(["rollout", "--config", str(path)]))
    assert (opts.reward, opts.max_turns) == (["number", "exact"], 2)


def test_config_values_are_checked_with_the_options_types(tmp_path, capsys):
    from agent_loop.cli import main

    path = tmp_path / "run.yaml"
    path.write_text("max_turn: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'max_turn'; did you mean 'max_turns'\?"):
        read_config(path, RolloutOptions)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_config(path, RolloutOptions)
    # values are checked by the same declarations as flags, before anything runs (exit 2, one line)
    for text, message in (("backend: torch\n", "--backend torch: must be one of auto, hf, vllm, http"),
                          ("max-turns: 2.5\n", "--max-turns 2.5"), ("max_turns: true\n", "--max-turns True: must be"),
                          ("reward: 3\n", "--reward")):
        path.write_text(text)
        assert main(["rollout", "--config", str(path), "--out", str(tmp_path / "r.jsonl")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollout_from_config_file_flags_override_and_resolved_config_saved(tmp_path, tiny_agent_dir, monkeypatch):
    from agent_loop.cli import main
    from agent_loop.runners.local import read_trajectories

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a}*3?", "answer": a * 3}) + "\n" for a in range(2, 9))
                       + "this line is broken\n")
    (tmp_path / "calc_tools.py").write_text("from agent_loop.tasks.builtin import calculator\n\nTOOLS = [calculator]\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"prompts": str(prompts), "reward": ["number"], "tools": str(tmp_path / "calc_tools.py"),
                                      "episodes": 50, "max-turns": 2, "concurrency": 4, "model": str(tiny_agent_dir),
                                      "out": str(tmp_path / "from_file.jsonl")}))
    out = tmp_path / "run" / "rollouts.jsonl"
    with pytest.warns(UserWarning, match=f"{prompts}:8: not JSON"):
        assert main(["rollout", "--config", str(config), "--episodes", "3", "--out", str(out), "--temperature", "0"]) == 0
    trajectories = sorted(read_trajectories(out), key=lambda t: t.info["index"])  # the file is in finishing order
    assert len(trajectories) == 3 and not (tmp_path / "from_file.jsonl").exists()
    assert [t.info["answer"] for t in trajectories] == [6, 9, 12] and all(t.metrics["turns"] <= 2 for t in trajectories)
    saved = yaml.safe_load((out.parent / "rollouts.config.yaml").read_text())
    assert saved["episodes"] == 3 and saved["max_turns"] == 2 and saved["temperature"] == 0.0
    assert saved["prompts"] == str(prompts) and saved["reward"] == ["number"] and saved["out"] == str(out)
    # the saved file reproduces the run
    rerun = tmp_path / "rerun.jsonl"
    assert main(["rollout", "--config", str(out.parent / "rollouts.config.yaml"), "--out", str(rerun)]) == 0
    rerun_trajectories = sorted(read_trajectories(rerun), key=lambda t: t.info["index"])
    assert [t.response_ids for t in rerun_trajectories] == [t.response_ids for t in trajectories]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_on_a_prompts_file_with_a_config_and_a_reward_module(tmp_path, tiny_agent_dir, capsys):
    from agent_loop.cli.train import main as train_main

    prompts = tmp_path / "sums.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a}+{a}*2?", "answer": a * 3}) + "\n" for a in range(10, 30)))
    (tmp_path / "my_rewards.py").write_text("def close(completion, answer):\n    return 1.0 if str(answer) in completion else 0.0\n")
    (tmp_path / "calc_tools.py").write_text("from agent_loop.tasks.builtin import calculator\n\nTOOLS = [calculator]\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(tiny_agent_dir), "prompts": str(prompts), "tools": str(tmp_path / "calc_tools.py"),
                                      "reward": [f"{tmp_path / 'my_rewards.py'}:close", "number"], "reward_weights": [0.5, 0.5],
                                      "steps": 1, "prompts_per_step": 2, "mini_batches": 1, "progress": False,
                                      "output_dir": str(tmp_path / "ignored")}))
    out = tmp_path / "train"
    assert train_main(["--config", str(config), "--output-dir", str(out), "--threads", "1"]) == 0
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and 0.0 <= record["reward"] <= 1.0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["output_dir"] == str(out) and saved["reward_weights"] == [0.5, 0.5] and saved["threads"] == 1
    assert not (tmp_path / "ignored").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 0.1\n")
    assert train_main(["--config", str(bad)]) == 2
    assert "unknown key 'learning_rate'" in capsys.readouterr().err


# --- model folders ----------------------------------------------------------------------------------


def model_folder(tmp_path, qwen_dir, template=None, **config):
    """A model folder with the real Qwen2.5 tokenizer, a config.json and a placeholder weights file."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(qwen_dir, folder)
    if template is not None:
        (folder / "chat_template.jinja").unlink()
        if template:
            (folder / "chat_template.jinja").write_text(template)
    settings = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                "num_attention_heads": 2, **config}
    (folder / "config.json").write_text(json.dumps(settings))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_usable_model_folder_passes(tmp_path, qwen_dir):
    from agent_loop.model_folders import check_model_dir

    info = check_model_dir(model_folder(tmp_path, qwen_dir), "vllm")
    assert (info.architecture, info.head_dim, info.tool_format) == ("Qwen2ForCausalLM", 32, "hermes")


def test_model_folder_problems_are_named_before_anything_loads(tmp_path, qwen_dir):
    from agent_loop.model_folders import ModelError, check_model_dir
    from tests.helpers.testdata import read_template

    with pytest.raises(ModelError, match="no such folder"):
        check_model_dir(tmp_path / "nope")
    with pytest.raises(ModelError, match="(?s)no config.json.*no tokenizer files.*no weights"):
        check_model_dir(tmp_path)
    folder = model_folder(tmp_path / "a", qwen_dir, hidden_size=32)  # head_dim 16
    with pytest.raises(ModelError, match="head size 16 is not supported by vLLM's CPU attention"):
        check_model_dir(folder, "vllm")
    assert check_model_dir(folder, "hf").head_dim == 16  # transformers runs any head size
    with pytest.raises(ModelError, match="no chat template"):
        check_model_dir(model_folder(tmp_path / "b", qwen_dir, template=""))
    with pytest.raises(ModelError, match="no tool-call format"):
        check_model_dir(model_folder(tmp_path / "c", qwen_dir, template=read_template("gemma-2-2b-it.jinja")))
    with pytest.raises(ModelError, match="model_type 'qwen9' is unknown to transformers"):
        check_model_dir(model_folder(tmp_path / "d", qwen_dir, model_type="qwen9"))


def test_cli_rejects_a_bad_model_folder_before_writing_anything(tmp_path, qwen_dir, capsys):
    from agent_loop.cli import main

    folder = model_folder(tmp_path, qwen_dir, hidden_size=32)
    out = tmp_path / "runs" / "r.jsonl"
    assert main(["rollout", "--model", str(folder), "--backend", "vllm", "--out", str(out)]) == 2
    assert "head size 16 is not supported by vLLM's CPU attention" in capsys.readouterr().err
    assert not out.parent.exists()


def test_a_reward_functions_signature_is_read_once_and_a_bad_one_always_fails(monkeypatch):
    """verl's AgentLoop builds a DatasetTask per row with the same reward functions: a plain function's signature
    is read once; a bound method is read each time (the cache must not keep its instance alive); a signature
    that cannot be served raises every time, not only the first."""
    import inspect

    from agent_loop.tasks.rewards import reward_terms

    reads = []
    real_signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn: reads.append(fn) or real_signature(fn))

    def close_enough(completion, answer):
        return float(completion == answer)

    class Scorer:
        def score(self, completion, row=None):
            return 1.0

    first, second = reward_terms(close_enough), reward_terms(close_enough)
    assert reads.count(close_enough) == 1
    assert first[0][3]({"completion": "4", "answer": "4", "row": {}}) == second[0][3](
        {"completion": "4", "answer": "4", "row": {}}) == {"completion": "4", "answer": "4"}
    scorer = Scorer()
    reward_terms(scorer.score), reward_terms(scorer.score)
    assert sum(getattr(fn, "__self__", None) is scorer for fn in reads) == 2

    def needs_a_budget(completion, budget):
        return 0.0

    for _ in range(2):
        with pytest.raises(TypeError, match="cannot pass its parameter 'budget'"):
            reward_terms(needs_a_budget)
