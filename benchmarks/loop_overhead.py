"""The agent loop's own cost per turn, with a scripted backend (no model), on the arithmetic task.

Overhead = episode wall time minus time inside ``backend.generate`` and inside tool calls: chat
formatting (each observation rendered from the episode's own messages in one go and checked against
what the model saw: docs/templates.md), decoding and parsing the assistant turn, tool dispatch, record keeping.
Baseline in the same run: re-rendering and re-tokenizing the whole conversation every turn, as a
loop without token-level deltas does (and which can silently change earlier tokens).

    .venv/bin/python benchmarks/loop_overhead.py [--episodes 200] [--tokenizer DIR]
"""

import argparse
import asyncio
import json
import statistics
import time

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import ToolExecutor
from agent_loop.tasks.registry import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the tiny agent's)")
    args = parser.parse_args()
    if args.tokenizer is None:
        from agent_loop.tiny import tiny_agent_path

        args.tokenizer = tiny_agent_path()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    task = get_task("arithmetic")
    episodes = [task.make_episode(i, 0) for i in range(args.episodes)]
    tool_response = tokenizer.convert_tokens_to_ids("<tool_response>")

    replies = {}  # per episode: (tool-call ids, answer ids), so the script costs a dict lookup
    for i, episode in enumerate(episodes):
        question = episode.messages[-1]["content"].split("What is ")[1].split("?")[0]
        call = {"name": "calculator", "arguments": {"expression": question}}
        replies[i] = (tokenizer.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>"),
                      tokenizer.encode(f"The answer is {episode.answer}."))
    current = {"index": 0}

    def script(prompt_ids):
        tool_ids, answer_ids = replies[current["index"]]
        return answer_ids if tool_response in prompt_ids else tool_ids

    backend = ScriptedBackend(script)
    config = LoopConfig()
    async def play_all():  # one after another in one event loop, as the runner does at concurrency 1
        played = []
        for i in range(args.episodes):
            current["index"] = i
            played.append(await run_episode(task, i, backend, tokenizer, config))
        return played

    overheads, totals, turns, exact = [], [], 0, 0
    for t in asyncio.run(play_all()):
        assert t.reward == 1.0, "the scripted episode must succeed"
        exact += t.metrics["template_exact"]
        turns += t.metrics["turns"]
        overheads.append((t.metrics["total_s"] - t.metrics["generate_s"] - t.metrics["tools_s"]) / t.metrics["turns"])
        totals.append(t.metrics["total_s"] / t.metrics["turns"])

    # Baseline: re-render + re-tokenize the whole chat after every turn.
    schemas = ToolExecutor(episodes[0].tools).schemas
    formatter = ChatFormatter(tokenizer, tools=schemas)
    rerender = []
    for i, episode in enumerate(episodes):
        tool_ids, answer_ids = replies[i]
        chat = list(episode.messages)
        started = time.perf_counter()
        formatter.prompt_ids(chat)
        chat += [{"role": "assistant", "content": tokenizer.decode(tool_ids)},
                 {"role": "tool", "name": "calculator", "content": str(episode.answer)}]
        formatter.prompt_ids(chat)
        rerender.append((time.perf_counter() - started) / 2)

    ours = statistics.median(overheads) * 1e3
    base = statistics.median(rerender) * 1e3
    table = Table(title=f"agent loop overhead per turn ({args.episodes} episodes, {turns} turns, scripted backend)")
    for column in ("measure", "median ms / turn", "vs. full re-render"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    table.add_row("loop overhead (excl. generate + tools)", f"{ours:.3f}", f"{ours / base:.2f}x")
    table.add_row("loop incl. tool calls (thread hop)", f"{statistics.median(totals) * 1e3:.3f}",
                  f"{statistics.median(totals) * 1e3 / base:.2f}x")
    table.add_row("baseline: re-render + re-tokenize chat", f"{base:.3f}", "1.00x")
    Console().print(table)
    Console().print(f"episodes whose tokens match a one-go render of their messages: {exact}/{args.episodes}")


if __name__ == "__main__":
    main()
