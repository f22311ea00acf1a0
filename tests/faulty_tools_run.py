"""Run by tests/runners/test_faults.py in a subprocess: a rollout whose tools misbehave in every way the issue lists.

argv: tokenizer dir, output path, episodes. Episode i calls tool number i % len(TOOLS) in its first
turn (hung tools: the first HUNG episodes), then answers "done". The process must finish the run and exit.
"""

import asyncio
import json
import sys
import threading
import time

from transformers import AutoTokenizer

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.types import Episode


def leave(code: int) -> str:
    """Exit the process.

    Args:
        code: Exit status.
    """
    sys.exit(code)


def interrupt(code: int) -> str:
    """Raise KeyboardInterrupt.

    Args:
        code: Unused.
    """
    raise KeyboardInterrupt


async def leave_async(code: int) -> str:
    """Exit the process from a coroutine.

    Args:
        code: Exit status.
    """
    raise SystemExit(code)


def surrogate(code: int) -> str:
    """Return a string with a lone surrogate.

    Args:
        code: Unused.
    """
    return "bad \ud800 text " * 10


def huge(code: int) -> str:
    """Return 5 MB.

    Args:
        code: Unused.
    """
    return "word " * 1_000_000


def block(code: int) -> str:
    """Block this thread forever.

    Args:
        code: Unused.
    """
    threading.Event().wait()
    return "never"


def fine(code: int) -> str:
    """Answer at once.

    Args:
        code: Echoed.
    """
    time.sleep(0.01)
    return f"ok {code}"


TOOLS = [leave, interrupt, leave_async, surrogate, huge, fine]
HUNG = 10


class FaultyTask:
    name = "faulty"

    def make_episode(self, index, seed=0):
        return Episode(messages=[{"role": "user", "content": f"Episode {index}: use the tools."}],
                       tools=TOOLS + [block], answer="done")

    def reward(self, episode, messages, tool_calls):
        return float(messages[-1]["role"] == "assistant" and "done" in messages[-1]["content"])


def main(tokenizer_dir: str, out: str, episodes: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def script(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        index = int(text.split("Episode ")[1].split(":")[0])
        if text.count("<|im_start|>assistant") > 1:
            return tokenizer.encode("done")
        name = "block" if index < HUNG else TOOLS[index % len(TOOLS)].__name__
        call = json.dumps({"name": name, "arguments": {"code": 3}})
        return tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>")

    config = LoopConfig(max_turns=3, tool_timeout_s=1.0, max_observation_tokens=64, max_response_tokens=512)
    started = time.perf_counter()
    trajectories = asyncio.run(run_rollouts(FaultyTask(), ScriptedBackend(script), tokenizer, range(episodes), config,
                                            concurrency=32, output_path=out, progress=False))
    print(json.dumps({"episodes": len(trajectories), "seconds": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
