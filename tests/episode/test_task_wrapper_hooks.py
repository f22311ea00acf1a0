"""One TaskWrapper forwards every Task hook (issue 37 item 7): the wrappers (as_task's, GroupedTask, ToolsetTask,
the verl loop's row task) override only what they change; none drops a hook (two of them used to drop ``demonstrate``)."""

import ast
import inspect
import pickle
import random
from pathlib import Path

import pytest

from agent_loop.episode.contracts import HOOKS, Task, TaskWrapper, as_task
from agent_loop.tasks.grouping import GroupedTask
from agent_loop.toolsets.task import ToolsetEnvironment, ToolsetTask
from agent_loop.types import Episode

ROOT = Path(__file__).resolve().parents[2]


def test_hooks_names_every_public_method_of_task():
    public = {name for name, value in vars(Task).items() if callable(value) and not name.startswith("_")}
    assert public == set(HOOKS)


class Recording(Task):
    """A task whose every hook answers with a value no default gives, and records that it was asked."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def make_episode(self, index, seed=0):
        self.calls.append("make_episode")
        return Episode(messages=[{"role": "user", "content": f"q{index}"}], tools=[], info={"q": index})

    def reward(self, episode, messages, tool_calls):
        self.calls.append("reward")
        return 0.25

    def success(self, episode, reward):
        self.calls.append("success")
        return "yes"

    def turn_rewards(self, episode, messages, tool_calls):
        self.calls.append("turn_rewards")
        return [0.5]

    def episode_metrics(self, episode, messages, tool_calls):
        self.calls.append("episode_metrics")
        return {"own": 3.0}

    def turn_states(self, episode, messages, tool_calls):
        self.calls.append("turn_states")
        return [("room", 1)]

    def demonstrate(self, episode, rng):
        self.calls.append("demonstrate")
        return [{"role": "assistant", "content": "solved"}]


ANSWERS = {"reward": 0.25, "success": "yes", "turn_rewards": [0.5], "episode_metrics": {"own": 3.0},
           "turn_states": [("room", 1)],
           "demonstrate": [{"role": "assistant", "content": "solved"}]}


def _ask(task: Task, hook: str, episode: Episode):
    args = {"reward": (episode, [], []), "success": (episode, 0.0), "turn_rewards": (episode, [], []),
            "episode_metrics": (episode, [], []), "turn_states": (episode, [], []),
            "demonstrate": (episode, random.Random(0)),
            "make_episode": (3, 0)}[hook]
    return getattr(task, hook)(*args)


@pytest.mark.parametrize("wrap", [TaskWrapper, lambda t: GroupedTask(t, group_size=2, question_seed=7),
                                  lambda t: ToolsetTask(t, [])],
                         ids=["TaskWrapper", "GroupedTask", "ToolsetTask"])
@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_forwarded_to_the_wrapped_task(wrap, hook):
    inner = Recording()
    wrapped = wrap(inner)
    assert wrapped.name == "recording"
    episode = inner.make_episode(0)
    inner.calls.clear()
    got = _ask(wrapped, hook, episode)
    assert inner.calls == [hook]
    if hook == "make_episode":
        assert got.info["q"] == (1 if isinstance(wrapped, GroupedTask) else 3)  # GroupedTask: question 3 // 2
        if isinstance(wrapped, ToolsetTask):
            assert isinstance(got.environment, ToolsetEnvironment) and got.tools == []
    else:
        assert got == ANSWERS[hook]


class Bare:
    """A task object that does not subclass Task: only the two hooks a task must have."""

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "q"}], tools=[])

    def reward(self, episode, messages, tool_calls):
        return 1.0


def test_a_task_object_that_is_no_task_gets_the_defaults_for_the_hooks_it_lacks():
    task = as_task(Bare())
    assert isinstance(task, TaskWrapper) and task.name == "Bare"
    episode = task.make_episode(0)
    assert task.reward(episode, [], []) == 1.0
    defaults = Task()
    for hook in HOOKS[2:]:
        assert _ask(task, hook, episode) == _ask(defaults, hook, episode), hook


def test_the_verl_row_task_is_a_task_wrapper_that_overrides_only_make_episode():
    """verl does not import in this environment: read the class from its source (its behaviour is tested in
    tests/integrations, in the verl side environment)."""
    tree = ast.parse((ROOT / "agent_loop/integrations/verl_agent_loop.py").read_text(encoding="utf-8"))
    prepared = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "_Prepared")
    assert [ast.unparse(base) for base in prepared.bases] == ["TaskWrapper"]
    assert {f.name for f in prepared.body if isinstance(f, ast.FunctionDef)} == {"__init__", "make_episode"}


class NoTools:
    """A tool set that adds no tool (what ToolsetTask does with tools is tested in tests/toolsets)."""

    name = "none"

    def tools(self):
        return []


def test_a_toolset_task_pickles_and_reads_the_tasks_attributes_through():
    """Ray workers get the task pickled: the hooks stay methods, and ``__getattr__`` answers no attribute
    before the state is restored."""
    inner = Recording()
    task = ToolsetTask(inner, [NoTools()])
    assert task.calls == ["make_episode"]  # read through: the wrapped task's own attribute
    copy = pickle.loads(pickle.dumps(task))
    assert isinstance(copy, ToolsetTask) and copy.name == "recording" and copy.calls == ["make_episode"]
    assert copy.reward(copy.make_episode(1), [], []) == 0.25
    with pytest.raises(AttributeError):
        task.no_such_attribute


def test_task_wrapper_defines_each_hook_itself():
    assert all(hook in vars(TaskWrapper) and inspect.isfunction(vars(TaskWrapper)[hook]) for hook in HOOKS)
