"""A one-tool task (``echo``) for the chat template tests (tests/episode, tests/inspect)."""

from agent_loop.types import Episode


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


class EchoTask:
    name = "echo"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": "Echo twice."}], tools=[echo], answer="done")

    def reward(self, episode, messages, tool_calls):
        return float("done" in messages[-1]["content"])
