"""Scripted replies for the loop's tests: a Hermes tool-call text and a reply-per-turn script."""

import json


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def turn_script(tokenizer, replies: list[str]):
    """Reply number k (k = assistant turns already in the prompt) is replies[k]."""

    def script(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer.encode(replies[min(turn, len(replies) - 1)])

    return script
