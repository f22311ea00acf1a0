"""fp32 against bf16 for the built-in SmolLM2-135M-Instruct: logprob agreement on a tool conversation and hf
decode speed (batch 8, greedy, one thread), with fp32 the baseline in the same run (docs/platform.md, "Built-in
models": why the conversion stores fp32).

    .venv/bin/python benchmarks/model_dtype.py
"""

import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loop.model_folders import model_path

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MESSAGES = [
    {"role": "user", "content": "What is 17 * 23 + 4? Use the calculator."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17 * 23 + 4"}}}]},
    {"role": "tool", "content": "395"},
    {"role": "assistant", "content": "The answer is 395."},
]


def token_logprobs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t - 1,)`` logprobs of each next token, and ``(t,)`` argmax tokens, in float32."""
    with torch.no_grad():
        logits = model(ids).logits.float()[0]
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0], logits.argmax(-1)


def decode_ms(model, prompt: torch.Tensor, tokens: int = 32) -> float:
    """Milliseconds per greedy decode step at batch ``prompt.shape[0]`` (after a short warm-up)."""
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=2)
        started = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=2)
    return (time.perf_counter() - started) / tokens * 1000


def main() -> None:
    torch.set_num_threads(1)
    folder = model_path("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]])
    prompt = torch.tensor([tokenizer.apply_chat_template(MESSAGES[:1], tools=TOOLS, add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"]] * 8)
    fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stored_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # bf16 storage, fp32 compute: what every backend here would run on a bf16 folder
        for parameter in stored_bf16.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    reference, reference_argmax = token_logprobs(fp32, ids)
    baseline_ms = decode_ms(fp32, prompt)
    table = Table(title=f"SmolLM2-135M, {ids.shape[1]}-token tool conversation; decode: batch 8, 1 thread")
    for column in ("stored / computed", "max |Δ logprob|", "mean |Δ|", "argmax agreement", "decode ms/step", "x fp32"):
        table.add_column(column)
    for name, model, ms in (("fp32 / fp32", fp32, baseline_ms), ("bf16 / fp32", stored_bf16, None),
                            ("bf16 / bf16", bf16, decode_ms(bf16, prompt))):
        logprobs, argmax = token_logprobs(model, ids)
        delta = (logprobs - reference).abs()
        table.add_row(name, f"{delta.max():.3f}", f"{delta.mean():.4f}", f"{(argmax == reference_argmax).float().mean():.1%}",
                      "as fp32" if ms is None else f"{ms:,.0f}", "" if ms is None else f"{ms / baseline_ms:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
