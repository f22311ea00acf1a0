"""Conformance of token-in/token-out formatting against real chat templates (docs/design.md section 4).

For every template in ``tests/data/chat_templates``, a multi-turn conversation is built token by
token (the prompt, each assistant turn's tokens taken from the full render, then the observation
delta of the messages that follow it) and must equal the full render of the same conversation; the
span labels must mark exactly the non-assistant tokens as OBSERVATION. Templates that are not
append-only must raise :class:`TemplateError` instead (listed below with the reason).
"""

import json
import re

import pytest

from agent_loop.episode.chat import ChatFormatter, TemplateError
from masking.spans import SpanKind
from tests.helpers.testdata import TEMPLATE_FILES, qwen_tokenizer_dir
from tests.helpers.testdata import TEMPLATES_DIR as TEMPLATES

# Special markers of the other families, added to the Qwen vocabulary (see tokenizers/README.md).
MARKER = re.compile(r"<\|[A-Za-z0-9_.:▁-]+\|>|</?[a-z]+:[a-z_]+>|<｜[^｜]*｜>|\[/?[A-Z_]{3,}\]|</?(?:start|end)_[a-z_]+>|<escape>"
                    r"|<\|[a-z_]+>|<[a-z_]+\|>|</?s>|<SPECIAL_\d+>|</?TOOLCALL>|\]~!?b[\[\]]|\[e~\[")  # Gemma 4: <|turn>, <turn|>, <|tool_call>, <|tool_response>, ...

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The expression."}},
                   "required": ["expression"]}}}

# Extra template variables some templates need (not tokenizer special tokens of the Qwen vocabulary).
TEMPLATE_KWARGS = {
    "firefunction-v2.jinja": {"functions": json.dumps([CALCULATOR["function"]]), "datetime": "2026-11-29"},
    "functionary-medium-v3.2.jinja": {"bos_token": "<|begin_of_text|>"},
}

# Templates that are not append-only: the formatter must refuse them with a TemplateError matching the pattern.
REWRITES_REASONING = "generation prompt is not how it renders the assistant turn"
NOT_APPEND_ONLY = {
    # the generation prompt opens <think>, which the template strips from rendered assistant turns
    "deepseek-r1-distill-llama-8b.jinja": REWRITES_REASONING,
    "deepseek-r1-distill-qwen-32b.jinja": REWRITES_REASONING,
    # the generation prompt opens <think>\n\n, which the turn loses once messages follow it
    "nemotron-nano-v2.jinja": "appending messages with roles \\['tool', 'tool'\\] rewrites the earlier text",
    # vLLM's Nemotron JSON templates: the same, and the calls of a last assistant message are not rendered at all
    "vllm_tool_chat_template_nemotron_json.jinja": "appending messages with roles \\['tool', 'tool'\\] rewrites the earlier text",
    "vllm_tool_chat_template_nemotron_nano_v2.jinja": "appending messages with roles \\['tool', 'tool'\\] rewrites the earlier text",
    # the reasoning of a tool-calling turn is dropped once its results follow
    "qwq-32b.jinja": "appending messages with roles \\['tool', 'tool'\\] rewrites the earlier text",
    # harmony: the analysis channel of a tool-calling turn is dropped once the final answer follows
    "gpt-oss-120b.jinja": "not how the next assistant turn renders",
    # the last tool response is rendered without the newline it gets once another message follows
    "hermes-2-pro-llama-3-8b-tool_use.jinja": "next assistant turn",
    "hermes-3-llama-3.1-8b-tool_use.jinja": "next assistant turn",
    "vllm_tool_chat_template_hermes.jinja": "next assistant turn",
    "vllm_tool_chat_template_hermes.f73e0891897f.jinja": "next assistant turn",
    # the generation prompt after a tool result ("\n<|header_start|>") is not how the answer renders
    "vllm_tool_chat_template_llama4_json.jinja": "next assistant turn",
    # the same for an earlier revision of vLLM's DeepSeek R1 template (whitespace before <｜tool▁outputs▁end｜>)
    "vllm_tool_chat_template_deepseekr1.80b25c67e1e2.jinja": "next assistant turn",
    # the system prompt (and tools) are rendered into the LAST user message only
    "mistral-nemo-instruct-2407.jinja": "assistant turn after the generation prompt",
    "vllm_tool_chat_template_mistral.jinja": "assistant turn after the generation prompt",
    "vllm_tool_chat_template_mistral_parallel.jinja": "assistant turn after the generation prompt",
    # the generation prompt differs from the rendered assistant turn (whitespace, thought channel, prefix)
    "vllm_tool_chat_template_deepseekv3.jinja": "assistant turn after the generation prompt",
    "vllm_tool_chat_template_deepseekv31.jinja": "assistant turn after the generation prompt",
    "vllm_tool_chat_template_gemma4.jinja": "assistant turn after the generation prompt",
    "vllm_tool_chat_template_granite_20b_fc.jinja": "assistant turn after the generation prompt",
    # the generation prompt's whitespace differs from the rendered turn's ("    <｜Assistant｜>      </think>")
    "vllm_tool_chat_template_deepseekv32.jinja": "assistant turn after the generation prompt",
    # the system prompt and tools move into the LAST user message
    "vllm_tool_chat_template_mistral_official.jinja": "assistant turn after the generation prompt",
    # Command R's closing instruction turn ("Write 'Action:' ...") is rendered after the last message, so an
    # assistant turn does not follow the generation prompt once it is in the history
    "vllm_command_r_tool_chat_template.jinja": "assistant turn after the generation prompt",
    # tool results are rendered inside the assistant turn; the generation prompt after them opens a new
    # <|assistant_start|> that the continued turn does not render
    "vllm_tool_chat_template_apertus.jinja": "not how the next assistant turn renders",
    "vllm_tool_chat_template_apertus.0ef539915149.jinja": "not how the next assistant turn renders",
    # ChatGLM "[Round N]\n问：...\n答：..." turns: plain text only, no special token to stop on
    "vllm_tool_chat_template_glm4.jinja": "no special token ends an assistant turn.*'\\\\n\\[Round 1\\]",
    # RWKV World "User: ...\n\nAssistant: ..." turns: plain text only
    "rwkv-world.jinja": "no special token ends an assistant turn.*'\\\\n\\\\n'",
    # each tool result repeats its call's name once per earlier result of the chat
    "solar-open-100b.jinja": "not append-only across rounds",
    # the generation prompt opens the reasoning (or a fixed preamble) that the rendered turn writes otherwise
    "apriel-1.6-15b-thinker-fixed.jinja": REWRITES_REASONING,
    "command-r-plus-tool_use.jinja": REWRITES_REASONING,
    "deepseek-v3.2.jinja": REWRITES_REASONING,
    "gemma-4-31b-it-interleaved.jinja": REWRITES_REASONING,
    # the generation prompt after tool results is not how the answer after them renders
    "bielik-11b-v3.0-instruct.jinja": "not how the next assistant turn renders",
    "glm-4.7-flash.jinja": "not how the next assistant turn renders",
    "lfm2.5-instruct.jinja": "not how the next assistant turn renders",
    "minimax-m2.jinja": "not how the next assistant turn renders",
    "nemotron-3-nano-30b-a3b.jinja": "not how the next assistant turn renders",
    # not renderable outside vLLM (it uses vLLM's own Jinja filter for tool results): refused when the formatter is made
    "vllm_tool_chat_template_gemma4.95ed3d757011.jinja": "No filter named 'tool_response_json_normalize'",
}
# Conversation-global state (only the first tool-output group opens <｜tool▁outputs▁begin｜>): exact, since
# observations are derived from the episode's own messages; a fixed synthetic prefix gets it wrong.
GLOBAL_STATE = "deepseek-r1-distill-qwen-32b.2025-02-04.jinja"


def call(i, expression):
    return {"id": f"call{i:05d}", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}


def result(i, content):
    return {"role": "tool", "name": "calculator", "tool_call_id": f"call{i:05d}", "content": content}


def tool_conversation(template: str) -> list[dict]:
    """Two tool turns (parallel calls where the template allows them), then a final answer."""
    first = ([call(1, "2+3"), call(2, "4*5")], [result(1, "5"), result(2, "20")])
    if "single tool-calls" in template:  # Llama 3.x: one call per turn
        first = ([call(1, "2+3")], [result(1, "5")])
    return [
        {"role": "user", "content": "What is (2+3)*(4*5)?"},
        {"role": "assistant", "content": "", "tool_calls": first[0]},
        *first[1],
        {"role": "assistant", "content": "", "tool_calls": [call(3, "5*20")]},
        result(3, "100"),
        {"role": "assistant", "content": "The answer is 100."},
    ]


def user_conversation() -> list[dict]:
    """Environment feedback as user turns (templates without tools)."""
    return [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "It is 6."},
        {"role": "user", "content": "Wrong, try again."},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Correct. And 4*5?"},
        {"role": "assistant", "content": "20."},
    ]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    markers = sorted({m for name in TEMPLATE_FILES for m in MARKER.findall((TEMPLATES / name).read_text())})
    vocab = tok.get_vocab()
    tok.add_special_tokens({"additional_special_tokens": [m for m in markers if m not in vocab]},
                           replace_extra_special_tokens=False)
    return tok


def conversation_for(name: str, template: str, formatter: ChatFormatter) -> list[dict]:
    uses_tools = "tool" in template
    messages = tool_conversation(template) if uses_tools else user_conversation()
    system = [{"role": "system", "content": "You are a careful assistant."}]
    string_args = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    for candidate in (system + messages, messages, system + string_args, string_args):  # Gemma 2 has no system role
        try:
            formatter.render_text(candidate)
            return candidate
        except TemplateError:
            pass
    raise AssertionError(f"{name}: the test conversation does not render")


def build_token_by_token(formatter: ChatFormatter, messages: list[dict]):
    """Prompt, then per assistant turn its text from the one-go render (encoded on its own, as sampled) and
    the observation the formatter derives from the episode's messages. Returns prompt, response, spans,
    the per-turn mismatches and the one-go render text."""
    full = formatter.render_text(messages)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt, seen = formatter.prompt(messages[:first])
    response, spans, mismatches, i = [], [], [], first
    while True:
        assert full.startswith(seen), f"context diverges from the full render before assistant message {i}"
        found = [(full.find(t, len(seen)), t) for t in formatter._stop_texts.values() if t in full[len(seen):]]
        start, end = next(((i, i + len(t)) for i, t in sorted(found)), (len(full), len(full)))  # the first marker
        turn = formatter.encode(full[len(seen): end])
        response += turn
        spans += [SpanKind.ASSISTANT] * len(turn)
        nxt = next((j for j in range(i + 1, len(messages)) if messages[j]["role"] == "assistant"), None)
        if nxt is None:
            return prompt, response, spans, mismatches, full
        stop = turn[-1] if turn and turn[-1] in formatter.end_of_turn_ids else None
        obs = formatter.observation(messages[: i + 1], seen, messages[i + 1: nxt], stop, full[len(seen): start])
        mismatches.append(obs.mismatch)
        response += obs.ids
        spans += [SpanKind.OBSERVATION] * len(obs.ids)
        seen, i = obs.rendered, nxt


def expected_assistant_texts(formatter: ChatFormatter, messages: list[dict]) -> list[str]:
    """Reference from text renders: each assistant turn is the full text after its generation prompt, up to
    its end-of-turn marker (or the next role's token, for families that end a turn by opening the next)."""
    full = formatter.render_text(messages)
    eot_texts = [formatter.tokenizer.decode([t]) for t in formatter.end_of_turn_ids]
    texts = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(formatter.render_text(messages[:i], add_generation_prompt=True))
        ends = [full.index(e, start) + len(e) for e in eot_texts if e in full[start:]]
        texts.append(full[start: min(ends) if ends else len(full)])
    return texts


def runs(ids: list[int], spans: list[int]):
    """Maximal runs of equal span kind: [(kind, ids)]."""
    out = []
    for tok, kind in zip(ids, spans):
        if out and out[-1][0] == kind:
            out[-1][1].append(tok)
        else:
            out.append((kind, [tok]))
    return out


def make_formatter(tokenizer, name: str, template: str) -> ChatFormatter:
    kwargs = {"bos_token": ""} | TEMPLATE_KWARGS.get(name, {})  # the Qwen vocabulary has no bos token
    return ChatFormatter(tokenizer, tools=[CALCULATOR], chat_template=template, **kwargs)


@pytest.mark.parametrize("name", [n for n in TEMPLATE_FILES if n not in NOT_APPEND_ONLY])
def test_token_by_token_equals_full_render(tokenizer, name):
    template = (TEMPLATES / name).read_text()
    formatter = make_formatter(tokenizer, name, template)
    messages = conversation_for(name, template, formatter)
    prompt, response, spans, mismatches, full = build_token_by_token(formatter, messages)
    assert mismatches == [None] * len(mismatches)
    # the text is the one-go render; the ids are each segment encoded as the model saw it
    text = tokenizer.decode(prompt + response, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert full.startswith(text) and messages[-1]["content"] in text
    assert len(spans) == len(response)
    # ASSISTANT runs are exactly the assistant turns of the text render; everything between is OBSERVATION
    kinds_and_runs = runs(response, spans)
    assistant_runs = [formatter.tokenizer.decode(r) for kind, r in kinds_and_runs if kind == SpanKind.ASSISTANT]
    assert assistant_runs == expected_assistant_texts(formatter, messages)
    assert [k for k, _ in kinds_and_runs][::2] == [SpanKind.ASSISTANT] * len(assistant_runs)
    observations = "".join(formatter.tokenizer.decode(r) for kind, r in kinds_and_runs if kind == SpanKind.OBSERVATION)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for m in messages[first:]:
        if m["role"] != "assistant":
            assert m["content"] in observations


@pytest.mark.parametrize("name", sorted(NOT_APPEND_ONLY))
def test_not_append_only_templates_raise(tokenizer, name):
    template = (TEMPLATES / name).read_text()
    with pytest.raises(TemplateError, match=NOT_APPEND_ONLY[name]):
        formatter = make_formatter(tokenizer, name, template)
        messages = conversation_for(name, template, formatter)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        nxt = next(j for j in range(first + 1, len(messages)) if messages[j]["role"] == "assistant")
        formatter.observation_ids(messages[first + 1: nxt])

