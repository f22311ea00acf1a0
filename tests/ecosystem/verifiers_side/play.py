"""Run in .side-envs/verifiers (tests/ecosystem/test_ecosystem_verifiers.py): the local verifiers tasksets of this
folder played through the loop by ``--task verifiers:ID`` on the tiny agent's tokenizer with scripted replies, and
the serial reference: verifiers' own objects (typed messages, its Toolset's tool method, its Task.score) on the
same completions, built here without the adapter. Prints one JSON line of what the test compares.

usage: play.py TINY_AGENT_DIR OUT.jsonl
"""

import asyncio
import json
import sys

import verifiers.v1 as vf
from transformers import AutoTokenizer
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask
from vf_tiny_tools import Calculator

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli import main as cli_main
from agent_loop.cli.flags import UsageError, validate
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.runners.local import read_trajectories
from agent_loop.tasks.plugins import PluginError
from agent_loop.tasks.registry import TaskOptions

CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def play(tokenizer, task, replies, index):
    def script(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer.encode(replies[min(turn, len(replies) - 1)])

    config = LoopConfig(max_turns=4, tool_timeout_s=60.0, max_tokens=256, max_response_tokens=2048)
    return asyncio.run(run_episode(task, index, ScriptedBackend(script), tokenizer, config))


def reference_reward(task, messages):
    """verifiers' own scoring of a transcript of its typed messages: a trace whose nodes are one branch, the
    assistant messages sampled, scored by Task.score (serially, one episode at a time)."""
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=vf.AgentConfig()))
    for i, message in enumerate(messages):
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=message,
                                       sampled=isinstance(message, vf.types.AssistantMessage)))
    asyncio.run(task.score(trace))
    return trace.reward, {k: r.score for k, r in trace.rewards.items()}


def record(traj, tokenizer, tool_schemas, reference):
    render = ChatFormatter(tokenizer, tools=tool_schemas).render(traj.messages)
    ids = traj.prompt_ids + traj.response_ids
    kinds = [int(s) for i, s in enumerate(traj.spans) if i == 0 or traj.spans[i - 1] != s]
    return {"reward": traj.reward, "reference": reference[0], "components": reference[1],
            "metrics": traj.metrics.get("task", {}), "finish": traj.finish_reason, "span_runs": kinds,
            "template_exact": bool(traj.metrics["template_exact"]), "render_prefix": render[:len(ids)] == ids,
            "messages": traj.messages, "error": traj.metrics.get("error")}


def math_cases(tokenizer):
    task = validate(TaskOptions, {"task": "verifiers:vf_tiny_math"}).load()
    out = []
    for index, reply in [(0, "5"), (1, "6"), (2, "9"), (3, "two")]:
        traj = play(tokenizer, task, [reply], index)
        vtask = task.tasks[index]
        typed = [vf.types.SystemMessage(content=vtask.data.system_prompt), vf.types.UserMessage(content=vtask.data.prompt),
                 vf.types.AssistantMessage(content=reply)]
        out.append(record(traj, tokenizer, [], reference_reward(vtask, typed)))
    return out


def tool_cases(tokenizer):
    task = validate(TaskOptions, {"task": "verifiers:vf_tiny_tools"}).load()
    schemas = task.make_episode(0).environment.tool_schemas
    out = []
    for index, (a, b), answer in [(0, (12, 30), "The sum is 42."), (1, (5, 9), "It is 15."), (2, (None, None), "123")]:
        replies = [CALL.format(a=a, b=b), answer] if a is not None else [answer]
        traj = play(tokenizer, task, replies, index)
        vtask = task.tasks[index]
        typed = [vf.types.UserMessage(content=vtask.data.prompt)]
        if a is not None:  # the call answered by verifiers' own Toolset method, serially
            call = vf.types.ToolCall(id="call_0", name="add", arguments=json.dumps({"a": a, "b": b}))
            typed += [vf.types.AssistantMessage(content=None, tool_calls=[call]),
                      vf.types.ToolMessage(tool_call_id="call_0", content=Calculator(vf.ToolsetConfig()).add(a, b))]
        typed.append(vf.types.AssistantMessage(content=answer))
        out.append(record(traj, tokenizer, schemas, reference_reward(vtask, typed)))
    return {"schemas": schemas, "episodes": out}


def dialogue_cases(tokenizer):
    task = validate(TaskOptions, {"task": "verifiers:vf_tiny_dialogue", "task_options": {"env": {"rounds": 3}}}).load()
    out = []
    for index, replies in [(0, ["apple", "Apple? apple.", "pear"]), (1, ["river", "river", "river"])]:
        traj = play(tokenizer, task, replies, index)
        vtask = task.tasks[index]
        typed = [vf.types.UserMessage(content=vtask.data.prompt)]
        for turn, reply in enumerate(replies):
            if turn:  # what EchoEnv.run says, written out here
                typed.append(vf.types.UserMessage(content=f"Round {turn}: you said {len(replies[turn - 1])} "
                                                          f"characters. Say {vtask.data.word} again."))
            typed.append(vf.types.AssistantMessage(content=reply))
        out.append({**record(traj, tokenizer, [], reference_reward(vtask, typed)),
                    "expected_users": [m.content[0].text if isinstance(m.content, list) else m.content
                                       for m in typed if isinstance(m, vf.types.UserMessage)]})
    return out


def broken_env(tokenizer):
    """An Env whose run raises at its second answer: the episode ends as an error with the reason."""
    task = validate(TaskOptions, {"task": "verifiers:vf_tiny_dialogue", "task_options": {"env": {"raise_at": 1}}}).load()
    traj = play(tokenizer, task, ["apple", "apple"], 0)
    return {"finish": traj.finish_reason, "error": traj.metrics.get("error"), "turns": sum(m["role"] == "assistant" for m in traj.messages)}


def one_line_errors():
    out = {}
    for spec, options in [("verifiers:vf_tiny_mth", {}), ("verifiers:harbor", {}),
                          ("verifiers:vf_tiny_math", {"no_such_field": 1})]:
        try:
            validate(TaskOptions, {"task": spec, "task_options": options}).load()
            out[spec] = None
        except (UsageError, PluginError, ValueError) as error:
            out[spec] = str(error)
    return out


def tiny_agent_rollout(model_dir, out):
    """``agent-loop rollout --task verifiers:vf_tiny_math`` with the tiny agent as the model, each trajectory's
    reward against verifiers' own scoring of its completion."""
    assert cli_main(["rollout", "--task", "verifiers:vf_tiny_math", "--episodes", "4", "--model", model_dir,
                     "--out", out]) == 0
    task = validate(TaskOptions, {"task": "verifiers:vf_tiny_math"}).load()
    rows = []
    for traj in sorted(read_trajectories(out), key=lambda t: t.info["index"]):
        vtask = task.tasks[traj.info["task_index"]]
        typed = [vf.types.SystemMessage(content=vtask.data.system_prompt), vf.types.UserMessage(content=vtask.data.prompt),
                 *[vf.types.AssistantMessage(content=m["content"]) for m in traj.messages[2:]]]
        rows.append({"reward": traj.reward, "reference": reference_reward(vtask, typed)[0],
                     "template_exact": bool(traj.metrics["template_exact"]), "finish": traj.finish_reason,
                     "prompt": traj.messages[:2], "task_prompt": vtask.data.prompt})
    return rows


def main():
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    print(json.dumps({"version": vf.__version__ if hasattr(vf, "__version__") else None,
                      "math": math_cases(tokenizer), "tools": tool_cases(tokenizer),
                      "dialogue": dialogue_cases(tokenizer), "broken": broken_env(tokenizer),
                      "errors": one_line_errors(), "rollout": tiny_agent_rollout(sys.argv[1], sys.argv[2])}))


if __name__ == "__main__":
    main()
