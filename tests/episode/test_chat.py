"""ChatFormatter with the real Qwen2.5 tokenizer and templates: prompt, observation delta, end-of-turn, errors."""


import pytest

from agent_loop.episode.chat import ChatFormatter, TemplateError
from tests.helpers.testdata import read_template

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):
    return qwen_tokenizer


@pytest.fixture(scope="module")
def formatter(tokenizer):
    return ChatFormatter(tokenizer, tools=[CALCULATOR])


def test_prompt_ids_equal_transformers_tokenized_render(tokenizer, formatter):
    expected = tokenizer.apply_chat_template(MESSAGES, tools=[CALCULATOR], add_generation_prompt=True, tokenize=True)
    assert formatter.prompt_ids(MESSAGES) == list(expected["input_ids"])
    assert tokenizer.decode(formatter.prompt_ids(MESSAGES)).endswith("<|im_start|>assistant\n")


def test_end_of_turn_ids(tokenizer, formatter):
    assert formatter.end_of_turn_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_observation_ids_after_stop(tokenizer, formatter):
    tool = [{"role": "tool", "name": "calculator", "content": "5"}]
    ids = formatter.observation_ids(tool)
    assert tokenizer.decode(ids) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    cut = formatter.observation_ids(tool, after_stop=False)
    assert cut == formatter.end_of_turn_ids[:1] + ids


def test_observation_of_a_real_turn_matches_the_full_render(tokenizer, formatter):
    """The sampled assistant tokens (a real tool-call turn) + the delta = the full render of the chat."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    tools = [{"role": "tool", "name": "calculator", "content": "5"}, {"role": "tool", "name": "calculator", "content": "6"}]
    sampled = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>')
    context = formatter.prompt_ids(MESSAGES) + sampled + formatter.observation_ids(tools)
    assert context == formatter.render(MESSAGES + [assistant] + tools, add_generation_prompt=True)


def test_synthetic_prefix_is_cached(formatter):
    tool = [{"role": "tool", "name": "calculator", "content": "1"}]
    formatter.observation_ids(tool)
    cached = dict(formatter.probe.synthetic)
    formatter.observation_ids([{**tool[0], "content": "a different result"}])
    assert formatter.probe.synthetic == cached


def test_empty_observation_is_rejected(formatter):
    with pytest.raises(ValueError, match="at least one new message"):
        formatter.observation_ids([])


def test_qwen3_user_turn_after_reasoning_is_not_append_only(tokenizer):
    """Qwen3 drops the reasoning of assistant turns before the last user query: a new user turn rewrites history."""
    qwen3 = ChatFormatter(tokenizer, tools=[CALCULATOR], chat_template=read_template("qwen3-0.6b.jinja"))
    assert qwen3.observation_ids([{"role": "tool", "name": "calculator", "content": "5"}])  # tool results are fine
    with pytest.raises(TemplateError, match="not append-only.*appending messages with roles \\['user'\\]"):
        qwen3.observation_ids([{"role": "user", "content": "And 4*5?"}])


def test_missing_end_of_turn_special_token_is_a_clear_error(tokenizer):
    llama = read_template("llama-3.1-8b-instruct.jinja")
    with pytest.raises(TemplateError, match="does not encode as a special token.*add_special_tokens"):
        ChatFormatter(tokenizer, chat_template=llama, bos_token="")


def test_render_failure_names_the_roles(formatter):
    with pytest.raises(TemplateError, match="failed to render messages with roles"):
        ChatFormatter(formatter.tokenizer, chat_template="{{ raise_exception('boom') }}")


ENCODE_TEXTS = ["", " leading space", "<|im_start|>user\nhé 2+3 = 5 ✓<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call>",
                "tabs\tand\n\nnewlines  ", "<|im_end|><|im_end|>x<|endoftext|>"]


def test_encode_equals_the_tokenizer_call_and_follows_the_backend_settings(tokenizer):
    """ChatFormatter.encode reads the fast tokenizer's backend directly, yet equals ``tokenizer(text)`` on special
    tokens, unicode and whitespace; a backend left with truncation or padding set, or a tokenizer that splits
    special tokens, goes through ``tokenizer(text)`` (the backend alone would cut, pad or split)."""
    import copy

    own = copy.deepcopy(tokenizer)
    formatter = ChatFormatter(own)
    assert formatter.encoder.backend is own._tokenizer  # the fast path is taken for Qwen2.5
    expected = [list(own(t, add_special_tokens=False)["input_ids"]) for t in ENCODE_TEXTS]
    assert [formatter.encode(t) for t in ENCODE_TEXTS] == expected
    long = ENCODE_TEXTS[2]
    own._tokenizer.enable_truncation(max_length=3)  # left by an earlier tokenizer(truncation=True) call
    assert formatter.encode(long) == expected[2] and len(expected[2]) > 3
    own._tokenizer.no_truncation()
    own._tokenizer.enable_padding(length=64)
    assert formatter.encode(long) == expected[2]
    own._tokenizer.no_padding()
    own.split_special_tokens = True
    split = formatter.encode(long)
    assert split == list(own(long, add_special_tokens=False)["input_ids"]) and split != expected[2]
