"""A task a real instruct model passes greedy with a real tool round trip: the user message shows the exact call
to make, the model copies it, and the tool's answer (upper-cased, so it cannot come from the prompt) is what the
next turn sees (tests/models)."""

from agent_loop.types import Episode

CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "blue"}}\n</tool_call>'


def echo(text: str) -> str:
    """Repeat the text back, upper-cased.

    Args:
        text: What to repeat.
    """
    return text.upper()


class CopyCall:
    """One call to make, shown in the prompt; success: the tool ran and the final answer holds its result."""

    name = "copy_call"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": f"Copy this exactly, nothing else:\n{CALL}"}],
                       tools=[echo], answer="BLUE")

    def reward(self, episode, messages, tool_calls):
        return float(any(c.name == "echo" and c.result == "BLUE" for c in tool_calls))
