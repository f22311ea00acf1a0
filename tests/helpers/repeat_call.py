"""A task a real instruct model keeps playing for turn after turn (tests/models/test_smollm2_sessions.py): the
copy-call task (tests/helpers/copy_call.py) whose environment, after the tool's answer, shows the same call
again in a user message of its own. Greedy, SmolLM2-135M-Instruct then copies the call, so an episode calls the
tool on every turn until ``max_turns`` (or its context) ends it. (After a tool answer alone, or one followed by a
user message with any words around the call, it copies the ``<tool_response>`` block instead and stops.)

The reward counts the tool's answers over the whole session (a segment alone holds fewer of them).
"""

import itertools

from agent_loop.episode.contracts import StepResult
from agent_loop.episode.tools import ToolEnvironment
from agent_loop.types import Episode
from tests.helpers.copy_call import CALL, CopyCall, echo

ASK = f"Copy this exactly, nothing else:\n{CALL}"


class AskAgain(ToolEnvironment):
    """The tool environment of ``echo``, with the call to make (:data:`CALL` alone) as a user message after every
    turn's tool results; with ``calls``, the turn after that many answered turns ends the episode (``done``)."""

    def __init__(self, calls: int | None = None):
        super().__init__([echo])
        self.calls, self.answered = calls, 0

    async def step(self, turn, limits):
        if self.calls is not None and self.answered == self.calls:
            return StepResult(done=True)
        result = await super().step(turn, limits)
        if result.observations:
            self.answered += 1
            result.observations.append({"role": "user", "content": CALL})
        return result


class RepeatCall(CopyCall):
    """The call to copy, asked again after every turn; reward: how many times the tool answered "BLUE"."""

    name = "repeat_call"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": ASK}], tools=[], environment=self.environment(),
                       answer="BLUE")

    def environment(self) -> AskAgain:
        return AskAgain()

    def reward(self, episode, messages, tool_calls):
        return float(sum(c.name == "echo" and c.result == "BLUE" for c in tool_calls))


class RepeatCallBudgets(RepeatCall):
    """:class:`RepeatCall` whose episodes answer 1, 2, 1, 2, ... calls (:attr:`BUDGETS`), in the order they are made:
    two samples of one question made one after the other, which greedy decoding plays alike, end after different
    numbers of calls, so their rewards (and their numbers of segments under a context policy) differ."""

    name = "repeat_call_budgets"
    BUDGETS = (1, 2)

    def __init__(self):
        self.made = itertools.count()

    def environment(self) -> AskAgain:
        return AskAgain(calls=self.BUDGETS[next(self.made) % len(self.BUDGETS)])
