"""Run inside the verl 0.9.1 side environment: verl's real ``AgentLoopWorker`` (its ``__init__`` from verl's
composed ``ppo_trainer`` config, its ``generate_sequences``, ``_run_agent_loop`` and ``_postprocess``) with our
AgentLoop, on a scripted token server standing in for verl's ``AsyncLLMServerManager`` (no model).

    python agent_loop_worker_run.py TOKENIZER_DIR WORK_DIR   # writes WORK_DIR/result.json

The scripted server reads the prompt like a model would: a question "What is the code of "KEY"?" gets a
hermes call of the verl tool ``code_lookup``, "What is EXPR?" a call of our ``calculator``; after a
``<tool_response>`` it answers with the number it read there; "Say many words." gets an endless reply.
"""

import asyncio
import json
import sys
from pathlib import Path

from verl_worker_common import LOOKUP_SCHEMA, ScriptedServer, batch_of, dump, model_dir, row, trainer_config

import agent_loop.integrations.verl_agent_loop as ours  # registers "agent_loop" in verl's registry


async def error_of(worker, rows) -> str:
    try:
        await worker.generate_sequences(batch_of(rows))
    except Exception as error:  # what a verl user sees
        return f"{type(error).__name__}: {error}"
    return "no error"


async def main(tokenizer_dir: Path, work: Path) -> dict:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry

    config = trainer_config(model_dir(tokenizer_dir, work), work)
    probe = ScriptedServer(None)
    worker = AgentLoopWorker(config, probe)
    probe.tokenizer = worker.tokenizer
    main_rows = [row('What is the code of "river"?', 0, "417", "agent_loop"),
                 row("What is it?", 3, None, "agent_loop_arith"),
                 row("Say many words.", 5, "7", "agent_loop")]
    out = await worker.generate_sequences(batch_of(main_rows))
    result = {"main": dump(out), "calls": list(probe.calls), "registry": sorted(_agent_loop_registry),
              "registered_target": _agent_loop_registry["agent_loop"]["_target_"]}
    probe.calls.clear()
    verl_scored = await worker.generate_sequences(batch_of([row('What is the code of "stone"?', 1, "902",
                                                                "agent_loop_verl_reward")]))
    result["verl_reward"] = dump(verl_scored)
    result["released"] = len(sys.modules["verl_side_tools"].RELEASED)
    result["errors"] = {
        "unknown_option": await error_of(worker, [row("Hi", 0, "1", "agent_loop_bad")]),
        "long_prompt": await error_of(worker, [row("word " * 600, 9, "1", "agent_loop")]),
    }
    result["lookup_schema"] = LOOKUP_SCHEMA
    result["agent_loop_module"] = ours.__name__
    return result


if __name__ == "__main__":
    tokenizer_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    result = asyncio.run(main(tokenizer_dir, work))
    (work / "result.json").write_text(json.dumps(result))
    print("wrote", work / "result.json")
