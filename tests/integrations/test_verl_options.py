"""The verl AgentLoop's options (``agent_loop.integrations.verl_options``, no verl needed): declared as every
option is, composed from the row options ``--prompts`` takes, read from verl's config shapes with verl's keys,
and every bad key or value one ``ValueError`` line naming ``agent_loop.KEY`` (issue 37 item 8). The AgentLoop
reading them from verl's real config: tests/integrations/test_verl_agent_loop.py (side environment)."""

import dataclasses

import pytest

from agent_loop.cli.rollout import RolloutOptions
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.integrations.verl_options import VerlLoopOptions
from agent_loop.recipes.train_options import TrainConfig
from agent_loop.recipes.warmstart_options import WarmstartConfig
from agent_loop.tasks.registry import DataTaskOptions, SeedOptions, TaskChoice, TaskOptions


def own_fields(cls) -> set[str]:
    """The fields ``cls`` declares itself (an inherited field given another default is none)."""
    own = set(cls.__dict__.get("__annotations__", {})) & {f.name for f in dataclasses.fields(cls)}
    return own - set(cls.__dict__.get("__overridden_defaults__", {}))


def test_the_row_options_are_declared_once_for_prompts_rows_and_verl_rows():
    assert issubclass(VerlLoopOptions, DataTaskOptions) and issubclass(TaskOptions, DataTaskOptions)
    for name in ("reward", "reward_weights", "system"):  # declared by DataTaskOptions alone, for both
        for cls in (VerlLoopOptions, TaskOptions):
            assert [c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {})] == [DataTaskOptions]
    commands = {name for root in (RolloutOptions, TrainConfig, WarmstartConfig) for cls in root.__mro__
                if dataclasses.is_dataclass(cls) for name in own_fields(cls)}
    assert own_fields(VerlLoopOptions) & commands == set()  # task and seed too: one declaration (issue 49)
    assert issubclass(VerlLoopOptions, (SeedOptions, TaskChoice)) and issubclass(TaskOptions, TaskChoice)
    assert VerlLoopOptions().task is None and VerlLoopOptions.from_mapping({"task": "arithmetic"}).task == "arithmetic"
    assert TaskOptions().task == "arithmetic"  # the commands' default; verl's is unset (each row is the episode)
    assert {f.name for f in dataclasses.fields(VerlLoopOptions)} == {  # verl users' keys, unchanged
        "task", "reward", "reward_weights", "tool_functions", "tool_format", "reward_source", "loop", "seed", "system"}


def test_verl_config_shapes_give_the_options_and_the_loop_config():
    options = VerlLoopOptions.from_mapping({"reward": "number", "reward_weights": 2, "loop": {"max_turns": 3},
                                            "system": None, "seed": 4})
    assert (options.reward, options.reward_weights, options.system, options.seed) == (["number"], [2.0], None, 4)
    assert options.scores == "agent_loop" and options.task is None
    config = options.loop_config(100)
    assert isinstance(config, LoopConfig) and (config.max_response_tokens, config.max_turns) == (100, 3)
    assert config.max_tokens == LoopConfig().max_tokens  # not given: LoopConfig's default
    # an agent_loop_config_path entry's null overrides the section's value with the default
    entry = VerlLoopOptions.from_mapping({"reward": None, "task": "arithmetic"})
    assert (entry.reward, entry.task, entry.scores) == ([], "arithmetic", "agent_loop")
    assert VerlLoopOptions.from_mapping({}).scores == "verl"
    assert VerlLoopOptions.from_mapping({"reward": ["number"], "reward_source": "verl"}).scores == "verl"


@pytest.mark.parametrize("values, message", [
    ({"max_turn": 3}, "agent_loop options: unknown key(s) ['max_turn']"),
    ({"reward_source": "ours"}, "agent_loop.reward_source='ours': Input should be 'auto', 'agent_loop' or 'verl'"),
    ({"tool_format": "hermez"}, "agent_loop.tool_format='hermez': 'hermez' is not one of ours; did you mean hermes?"),
    ({"task": "arithmetc"}, "agent_loop.task='arithmetc': unknown task; did you mean arithmetic?"),
    ({"loop": {"max_turn": 1}}, "agent_loop.loop={'max_turn': 1}: unknown key(s) ['max_turn']; did you mean max_turns?"),
    ({"loop": {"max_turns": 0}}, "agent_loop.loop={'max_turns': 0}: max_turns=0: Input should be greater than or equal to 1"),
    ({"seed": -1}, "agent_loop.seed=-1: Input should be greater than or equal to 0"),
    ({"loop": {"context": "window"}}, "agent_loop.loop={'context': 'window'}: context='window' splits an episode into "
                                      "segments of one session, and verl's AgentLoop returns one row per sample"),
    ({"task": "arithmetic", "reward": "number"}, "give either agent_loop.task (it brings its reward) or agent_loop.reward"),
    ({"reward_source": "agent_loop"}, "agent_loop.reward_source agent_loop: needs agent_loop.task or agent_loop.reward"),
])
def test_a_bad_key_or_value_is_one_line_naming_it(values, message):
    with pytest.raises(ValueError) as error:
        VerlLoopOptions.from_mapping(values)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_loop_budget_over_verls_response_length_is_an_error():
    options = VerlLoopOptions.from_mapping({"loop": {"max_response_tokens": 200}})
    assert options.loop_config(200).max_response_tokens == 200
    with pytest.raises(ValueError, match=r"max_response_tokens=200 exceeds verl's rollout.response_length=100"):
        options.loop_config(100)


def test_verl_check_without_verl_is_one_line_and_exit_1(capsys):
    from agent_loop.cli import main

    assert main(["verl-check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("agent-loop verl-check: needs verl in this environment: No module named 'verl'")
    assert err.count("\n") == 1
