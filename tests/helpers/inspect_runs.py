"""Rollout files for the inspect tests and docs: the real runner, the arithmetic task, the real Qwen2.5
tokenizer and chat template, and a scripted backend (loop logic only, no model) in two flavours, so
that two runs of the same episodes differ the way a run before and after training does.

``python -m tests.helpers.inspect_runs OUT_DIR [EPISODES]`` writes ``before.jsonl`` and ``after.jsonl``.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sys
from pathlib import Path

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.builtin import ArithmeticTask

CONFIG = LoopConfig(max_turns=4, max_tokens=64, max_response_tokens=512)
SEED = 3


def calculator_script(tokenizer, skill: str, prompt_ids: list[int]) -> list[int]:
    """A calculator call to the question, then the tool's result as the answer.

    ``skill="before"``: a malformed call first on some episodes, and on others a wrong answer (the
    result plus one) or no tool call at all; ``"after"``: only the occasional malformed call."""
    text = tokenizer.decode(prompt_ids)
    last_message = text.rsplit("<|im_start|>", 2)[-2]  # the last one is the open assistant turn
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last_message, re.S)
    expression = re.findall(r"What is (.*?)\?", text)[-1]
    weak = skill == "before"
    if weak and len(prompt_ids) % 5 == 1 and not results:
        return tokenizer.encode("I think the answer is 7.")  # guesses, no tool: a failure
    if results and not results[-1].startswith("Error"):
        answer = results[-1]
        if weak and len(prompt_ids) % 4 == 0:
            answer = str(int(float(answer)) + 1)
        return tokenizer.encode(f"The answer is {answer}.")
    broken = len(prompt_ids) % (3 if weak else 7) == 0 and not results
    call = '{"name": "calculator", "arguments": {"expression": "%s"}%s}' % (expression, "," if broken else "")
    return tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>")


def write_run(tokenizer, path: Path, skill: str, episodes: int = 12) -> list:
    """Play ``episodes`` arithmetic episodes with the scripted backend and write them to ``path``."""
    script = functools.partial(calculator_script, tokenizer, skill)
    path.write_text("")
    return asyncio.run(run_rollouts(ArithmeticTask(), ScriptedBackend(script), tokenizer, range(episodes), CONFIG,
                                    seed=SEED, concurrency=4, output_path=path, progress=False))


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from tests.helpers.testdata import qwen_tokenizer_dir

    out = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()), local_files_only=True)
    for skill in ("before", "after"):
        write_run(tok, out / f"{skill}.jsonl", skill, n)
        print(out / f"{skill}.jsonl")
