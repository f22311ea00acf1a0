"""A quick two-turn check of the tiny agent with ``transformers`` generate (not the real agent loop).

Turn 1: the model should call the task's tool. The call is parsed, the real tool runs, and the
tool message is appended as the chat template renders it. Turn 2: the model should answer. The
task's own reward scores the answer.
"""

from __future__ import annotations

import json
import re

import torch
from transformers import PreTrainedTokenizerFast, PreTrainedModel
from transformers.utils import get_json_schema

from agent_loop.tasks import get_task
from agent_loop.tiny.data import render, tool_call_message

MAX_NEW_TOKENS = 64
_TOOL_CALL = re.compile(r"^<tool_call>\n(.*?)\n</tool_call><\|im_end\|>$", re.DOTALL)


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """(name, arguments) of a reply that is exactly one Hermes-style tool call, else None."""
    match = _TOOL_CALL.match(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
        return None
    return call["name"], call["arguments"]


@torch.no_grad()
def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[list[int]], greedy: bool, seed: int) -> list[list[int]]:
    """Continue each prompt until ``<|im_end|>`` (kept) or MAX_NEW_TOKENS; left-padded batch."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=not greedy,
        temperature=None if greedy else 1.0,
        top_k=None if greedy else 0,
        top_p=None if greedy else 1.0,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=pad,
    )
    replies = []
    for row in out[:, width:].tolist():
        end = row.index(model.config.eos_token_id) + 1 if model.config.eos_token_id in row else len(row)
        replies.append(row[:end])
    return replies


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, task_name: str, episodes: int, seed: int, greedy: bool
) -> dict:
    """Rates over ``episodes`` held-out episodes: well-formed tool call, correct tool arguments, success."""
    task = get_task(task_name)
    batch = [task.make_episode(index, seed) for index in range(episodes)]
    prompts = [
        tokenizer.apply_chat_template(e.messages, tools=[get_json_schema(t) for t in e.tools], add_generation_prompt=True, tokenize=False)
        for e in batch
    ]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    first = generate(model, tokenizer, prompt_ids, greedy, seed)
    well_formed, right_arguments, follow_ups, finals = 0, 0, [], {}
    for row, (episode, reply) in enumerate(zip(batch, first)):
        call = parse_tool_call(tokenizer.decode(reply))
        tools = {t.__name__: t for t in episode.tools}
        if call is None or call[0] not in tools:
            finals[row] = tokenizer.decode(reply, skip_special_tokens=True)
            continue
        well_formed += 1
        name, arguments = call
        ideal = {"expression": episode.info.get("expression")} if task_name == "arithmetic" else {"key": episode.info.get("key")}
        right_arguments += arguments == ideal
        try:
            result = str(tools[name](**arguments))
        except (TypeError, ValueError) as error:
            result = f"Error: {error}"
        schemas = [get_json_schema(t) for t in episode.tools]
        history = episode.messages + [tool_call_message(name, arguments)]
        before = render(tokenizer, history, schemas)
        after = tokenizer.apply_chat_template(
            history + [{"role": "tool", "content": result}], tools=schemas, add_generation_prompt=True, tokenize=False
        )
        # the model stopped on <|im_end|>; the template's "\n" after it and the tool turn follow
        observation = tokenizer("\n" + after[len(before) :])["input_ids"]
        follow_ups.append((row, prompt_ids[row] + reply + observation))
    if follow_ups:
        second = generate(model, tokenizer, [ids for _, ids in follow_ups], greedy, seed + 1)
        for (row, _), reply in zip(follow_ups, second):
            finals[row] = tokenizer.decode(reply, skip_special_tokens=True)
    successes = sum(
        task.reward(episode, episode.messages + [{"role": "assistant", "content": finals[row]}], [])
        for row, episode in enumerate(batch)
    )
    return {
        "task": task_name,
        "episodes": episodes,
        "greedy": greedy,
        "well_formed": well_formed / episodes,
        "right_arguments": right_arguments / episodes,
        "success": successes / episodes,
    }
