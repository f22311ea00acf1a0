"""skyrl-gym environments: ``--task skyrl_gym:ENV_ID --prompts ROWS`` (docs/ecosystem.md).

Rows are skyrl-train's dataset rows: ``prompt`` (chat messages or a string) and the environment's
``extras`` (every other column: ``reward_spec``, ``extra_info``, ``db_id``, ...; ``env_class``, if given,
must be ENV_ID). Episode ``i`` plays row ``i % len(rows)``: ``skyrl_gym.make(ENV_ID, env_config=...,
extras=row)``, its ``init(prompt)`` gives the prompt, and its ``step(text)`` answers every assistant turn
(:class:`SkyRLEnvironment`): the observations are appended as the chat template renders them, the step's
reward is that turn's reward, ``done`` ends the episode. The task options are the environment's
``env_config`` (text2sql: ``db_path``). Environments that need a network service (``search``,
``searchcode``: a retrieval server) are refused.
"""

from __future__ import annotations

import copy

import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.registration import registry

from agent_loop.episode.contracts import AssistantTurn, StepLimits, StepResult, Task, TurnEnvironment
from agent_loop.options import closest
from agent_loop.tasks.dataset import load_prompts
from agent_loop.types import Episode, ToolCallRecord

NEEDS_PROMPTS = True
REFUSED = {name: f"skyrl_gym:{name} needs a retrieval server over the network (its search_url); not supported "
           "(docs/ecosystem.md)" for name in ("search", "searchcode")}


def names() -> list[str]:
    return sorted(set(registry) - set(REFUSED))


class SkyRLEnvironment(TurnEnvironment):
    """One skyrl-gym environment instance as the environment of an episode's turns."""

    def __init__(self, env):
        self.env = env

    def step(self, turn: AssistantTurn, limits: StepLimits) -> StepResult:
        output = self.env.step(turn.text)
        if not isinstance(output, dict) or not {"observations", "reward", "done"} <= set(output):
            raise TypeError(f"{type(self.env).__name__}.step returned {type(output).__name__} {output!r:.100}, not "
                            "a BaseTextEnvStepOutput (observations, reward, done, metadata)")
        metadata = dict(output.get("metadata") or {})
        if output.get("postprocessed_action") is not None:  # recorded; the tokens stay as sampled
            metadata["postprocessed_action"] = output["postprocessed_action"]
        observations = output["observations"] or []
        if not isinstance(observations, list):
            raise TypeError(f"{type(self.env).__name__}.step returned observations {observations!r:.100}, not a list")
        return StepResult(observations=[dict(m) for m in observations], reward=output["reward"],
                          done=output["done"], metadata=metadata)

    def close(self) -> None:
        self.env.close()


class SkyRLGymTask(Task):
    """The rows of ``prompts`` played in the skyrl-gym environment ``env_id`` (see the module docstring)."""

    def __init__(self, env_id: str, prompts, env_config: dict | None = None, system: str | None = None):
        if env_id in REFUSED:
            raise ValueError(REFUSED[env_id])
        if env_id not in names():
            raise ValueError(f"unknown skyrl-gym environment {env_id!r}{closest(env_id, names())} "
                             f"(registered here: {', '.join(names())})")
        self.env_id, self.name = env_id, f"skyrl_gym:{env_id}"
        self.rows, self.skipped = load_prompts(prompts)
        for i, row in enumerate(self.rows):
            if row["row"].get("env_class", env_id) != env_id:
                raise ValueError(f"row {i}: env_class {row['row']['env_class']!r}, but the task plays {env_id!r}")
        self.env_config = OmegaConf.create(dict(env_config or {}))
        self.system = system
        try:  # the first row's environment, made and closed now: a bad env_config or row is one line before any work
            self.make_episode(0).environment.close()
        except Exception as error:
            raise ValueError(f"skyrl_gym:{env_id}: row 0 (task options {dict(env_config or {})}): the environment "
                             f"refused it: {type(error).__name__}: {error}") from None

    def make_episode(self, index: int, seed: int = 0) -> Episode:
        row_index = index % len(self.rows)
        row = self.rows[row_index]
        extras = {k: copy.deepcopy(v) for k, v in row["row"].items() if k != "env_class"}
        if row["answer"] is not None:
            extras["answer"] = row["answer"]
        env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=extras)
        messages = copy.deepcopy(row["messages"])
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        prompt, _ = env.init(messages)
        return Episode(messages=[dict(m) for m in prompt], tools=[], environment=SkyRLEnvironment(env),
                       answer=(extras.get("reward_spec") or {}).get("ground_truth"),
                       info={"row_index": row_index, "row": row["row"]})

    def reward(self, episode: Episode, messages: list[dict], tool_calls: list[ToolCallRecord]) -> float:
        return 0.0  # the environment's step rewards are the episode's (the loop adds them)


def load(name: str, *, prompts: str | None = None, options: dict | None = None, system: str | None = None) -> Task:
    """``--task skyrl_gym:ENV_ID --prompts ROWS`` with the environment's env_config as task options."""
    if prompts is None:
        raise ValueError(f"skyrl_gym:{name} plays rows: give --prompts ROWS (skyrl-train's dataset rows)")
    return SkyRLGymTask(name, prompts, options, system)
