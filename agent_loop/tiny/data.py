"""Synthetic tool-use dialogues of the built-in tasks, exactly as the agent loop produces them.

A dialogue is: user question -> assistant tool call -> tool result (computed by the real tool) ->
(for ``chain``, a second call and result) -> assistant final answer, rendered by the chat template with the task's tool schemas. Training
puts the loss on assistant tokens only: everything after ``<|im_start|>assistant\\n`` up to and
including ``<|im_end|>``.
"""

from __future__ import annotations

import random
import re

import torch
from transformers import PreTrainedTokenizerFast
from transformers.utils import get_json_schema

from agent_loop.tasks.registry import get_task

# share of lookup dialogues; the rest is arithmetic (the harder task, and the default one)
LOOKUP_SHARE = 0.25
FINAL_ANSWER = {"arithmetic": "The answer is {}.", "lookup": "The code is {}.", "chain": "The code is {}."}
_ASSISTANT_CONTENT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def tool_call_message(name: str, arguments: dict) -> dict:
    """An assistant message that calls one tool (the OpenAI/HF chat shape the templates read)."""
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def ideal_calls(task_name: str, info: dict) -> list[tuple[str, dict]]:
    """The tool calls (name, arguments) of an ideal episode, in order, from the episode's ``info``."""
    calculate = ("calculator", {"expression": info.get("expression")})
    look_up = ("lookup", {"key": info.get("key")})
    return {"arithmetic": [calculate], "lookup": [look_up], "chain": [calculate, look_up]}[task_name]


def dialogue(task_name: str, index: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The ideal full conversation of one episode and its tool schemas: (messages, tools)."""
    episode = get_task(task_name).make_episode(index, seed)
    tools = {tool.__name__: tool for tool in episode.tools}
    messages = list(episode.messages)
    for name, arguments in ideal_calls(task_name, episode.info):
        messages += [tool_call_message(name, arguments), {"role": "tool", "content": tools[name](**arguments)}]
    messages.append({"role": "assistant", "content": FINAL_ANSWER[task_name].format(episode.answer)})
    return messages, [get_json_schema(tool) for tool in episode.tools]


def task_for(index: int, seed: int) -> str:
    """Which task dialogue ``index`` of the training stream is (deterministic)."""
    return "lookup" if random.Random(f"mix:{seed}:{index}").random() < LOOKUP_SHARE else "arithmetic"


def render(tokenizer: PreTrainedTokenizerFast, messages: list[dict], tools: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)


def encode_batch(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize rendered dialogues and right-pad them.

    Returns ``input_ids`` (b, t), ``attention_mask`` (b, t) and ``labels`` (b, t): the input ids on
    assistant tokens (``<|im_end|>`` included) and -100 elsewhere.
    """
    encodings = tokenizer._tokenizer.encode_batch(texts)
    width = max(len(e.ids) for e in encodings)
    input_ids = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(texts), width), dtype=torch.long)
    labels = torch.full((len(texts), width), -100, dtype=torch.long)
    for row, (text, encoding) in enumerate(zip(texts, encodings)):
        ids = torch.tensor(encoding.ids)
        starts = torch.tensor([start for start, _ in encoding.offsets])
        in_assistant = torch.zeros(len(ids), dtype=torch.bool)
        for match in _ASSISTANT_CONTENT.finditer(text):
            begin, end = match.span(1)
            in_assistant |= (starts >= begin) & (starts < end)
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(in_assistant, ids, -100)
    return input_ids, attention_mask, labels
