"""A custom task: reverse a word, with a tool. Run it: python examples/custom_task.py [MODEL_DIR]"""
import sys

from agent_loop import Environment, rollout


def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: The string to reverse.
    """
    return text[::-1]


class Reverse(Environment):
    tools = [reverse]

    def sample(self, rng):
        word = rng.choice(["apple", "river", "stone", "cloud", "tiger", "lemon"])
        return {"prompt": f"Reverse the word {word}.", "answer": word[::-1]}

    def score(self, completion, answer):
        return float(answer in completion)

    def demonstrate(self, episode, rng):  # a solved episode, for `agent-loop warmstart`
        call = {"name": "reverse", "arguments": {"text": episode.answer[::-1]}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "assistant", "content": f"The answer is {episode.answer}."}]


if __name__ == "__main__":
    trajectories = rollout(Reverse(), model=(sys.argv[1:] or [None])[0], episodes=8, max_turns=3)
    print(f"mean reward {sum(t.reward for t in trajectories) / len(trajectories):.2f} over {len(trajectories)} episodes")
