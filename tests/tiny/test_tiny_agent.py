"""The built-in tiny agent: tokenizer, chat template, training loss, cache, and the built model."""

import threading
import time

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from agent_loop.tiny import build as tiny_build
from agent_loop.tiny.data import dialogue, encode_batch, render, task_for
from agent_loop.tiny.evaluate import evaluate
from agent_loop.tiny.tokenizer import SPECIAL_TOKENS, chat_template, train_tokenizer
from agent_loop.tiny.train import (
    BATCH_SIZE,
    FINAL_LR_FRACTION,
    LEARNING_RATE,
    WARMUP_STEPS,
    model_config,
    training_batch,
)
from agent_loop.training.finetune import labelled_loss
from agent_loop.training.tiny_agent import learning_rate


@pytest.fixture(scope="module")
def tokenizer():
    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=chat_template())
    return train_tokenizer([render(renderer, *dialogue(task_for(i, 0), i, 0)) for i in range(400)])


def conversation(task: str, index: int, seed: int = 99):
    return dialogue(task, index, seed)


def ids_of(tokenizer, messages, tools, generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True)["input_ids"]


def test_special_tokens_are_single_ids(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and tokenizer.unk_token_id not in ids
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tokenizer(token)["input_ids"] == [token_id]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # tool markers survive skip_special_tokens (as in Qwen2.5), control tokens do not
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_auto_tokenizer_loads_it_identically(tokenizer, tmp_path):
    """AutoTokenizer (and so vLLM) must use tokenizer.json as saved, our pre-tokenizer included.

    (A ``model_type: qwen2`` folder would load as Qwen2Tokenizer, which swaps in Qwen2's pre-tokenizer.)
    """
    tokenizer.save_pretrained(tmp_path)
    model_config(tokenizer).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert type(loaded).__name__ != "Qwen2Tokenizer"
    for index in range(10):
        messages, tools = conversation(task_for(index, 8), index, 8)
        expected = raw.encode(render(tokenizer, messages, tools)).ids
        assert ids_of(loaded, messages, tools) == ids_of(tokenizer, messages, tools) == expected
        prompt = loaded.apply_chat_template(messages[:1], tools=tools, add_generation_prompt=True, tokenize=False)
        assert loaded(prompt)["input_ids"] == raw.encode(prompt).ids
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|> héllo ✓"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)
    assert loaded.eos_token_id == tokenizer.eos_token_id and loaded.pad_token_id == tokenizer.pad_token_id


@pytest.mark.parametrize("text", ["What is 37 * 12 + 5?", "héllo wörld ✓ 日本", "  spaces\n\n\ttabs  ", '{"key": "river"}', ""])
def test_tokenizer_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_round_trips_dialogues(tokenizer):
    for index in range(20):
        text = render(tokenizer, *conversation(task_for(index, 5), index, 5))
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_digits_newlines_and_quoted_keys_are_single_pieces(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("12345\n67")["input_ids"])
    assert pieces == ["1", "2", "3", "4", "5", "Ċ", "6", "7"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("-77")["input_ids"]) == ["-", "7", "7"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("37*12+5")["input_ids"]) == ["3", "7", "*", "1", "2", "+", "5"]
    assert tokenizer.convert_ids_to_tokens(tokenizer('5"}}\n\n')["input_ids"]) == ["5", '"}}', "Ċ", "Ċ"]
    question = tokenizer('What is the code of "river"?')["input_ids"]
    call = tokenizer('{"name": "lookup", "arguments": {"key": "river"}}')["input_ids"]
    (river,) = tokenizer('"river"')["input_ids"]
    assert river in question and river in call


@pytest.mark.parametrize("task", ["arithmetic", "lookup"])
def test_template_is_append_only(tokenizer, task):
    """Rendering a conversation prefix (at a turn boundary) gives a token prefix of the full render."""
    messages, tools = conversation(task, 1)
    full = ids_of(tokenizer, messages, tools)
    for cut in range(1, len(messages)):
        prefix = ids_of(tokenizer, messages[:cut], tools)
        assert full[: len(prefix)] == prefix, f"prefix of {cut} messages"
        if messages[cut]["role"] == "assistant":
            with_prompt = ids_of(tokenizer, messages[:cut], tools, generation_prompt=True)
            assert full[: len(with_prompt)] == with_prompt, f"generation prompt after {cut} messages"


def test_rendered_conversation_format(tokenizer):
    messages, tools = conversation("arithmetic", 0, seed=1)
    expression = messages[0]["content"][len("What is ") : -1]
    result = messages[2]["content"]
    text = render(tokenizer, messages, tools)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert text.endswith(
        f"<|im_start|>user\nWhat is {expression}?<|im_end|>\n"
        f'<|im_start|>assistant\n<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is {result}.<|im_end|>\n"
    )


def test_labels_cover_exactly_the_assistant_turns(tokenizer):
    conversations = [conversation(task_for(i, 3), i, 3) for i in range(6)]
    input_ids, attention_mask, labels = encode_batch(tokenizer, [render(tokenizer, *c) for c in conversations])
    for row, (messages, tools) in enumerate(conversations):
        # reference: the assistant turns' token spans, found by rendering message prefixes
        expected = []
        for cut, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(ids_of(tokenizer, messages[:cut], tools, generation_prompt=True))
                end = len(ids_of(tokenizer, messages[: cut + 1], tools)) - 1  # drop the "\n" after <|im_end|>
                expected += list(range(start, end))
        supervised = (labels[row] != -100).nonzero().flatten().tolist()
        assert supervised == expected
        assert labels[row, supervised].tolist() == input_ids[row, supervised].tolist()
        assert tokenizer.decode(input_ids[row, expected[-1]]) == "<|im_end|>"
        length = len(ids_of(tokenizer, messages, tools))
        assert attention_mask[row].sum() == length and (input_ids[row, length:] == tokenizer.pad_token_id).all()


def test_shared_prefix_loss_equals_full_forward(tokenizer):
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(tokenizer))
    for input_ids, labels in training_batch(tokenizer, step=0, seed=4):
        loss, count = labelled_loss(model, input_ids, labels)
        # reference: one plain forward over the full right-padded sequences
        logits = model(input_ids).logits
        reference = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        assert count == int((labels != -100).sum())
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-4)
        (grad,) = torch.autograd.grad(loss, model.model.embed_tokens.weight)
        (reference_grad,) = torch.autograd.grad(reference, model.model.embed_tokens.weight)
        torch.testing.assert_close(grad, reference_grad, rtol=1e-3, atol=1e-3)


def test_training_batches_are_deterministic_and_fresh(tokenizer):
    first = training_batch(tokenizer, step=2, seed=1)
    again = training_batch(tokenizer, step=2, seed=1)
    other = training_batch(tokenizer, step=3, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert sum(ids.shape[0] for ids, _ in first) == BATCH_SIZE
    assert not torch.equal(first[0][0][:, :50], other[0][0][:, :50]) or first[0][0].shape != other[0][0].shape


def test_learning_rate_schedule():
    assert learning_rate(0, 1000) == pytest.approx(LEARNING_RATE / WARMUP_STEPS)
    assert learning_rate(WARMUP_STEPS, 1000) == pytest.approx(LEARNING_RATE)
    assert learning_rate(1000, 1000) == pytest.approx(LEARNING_RATE * FINAL_LR_FRACTION)
    rates = [learning_rate(s, 1000) for s in range(WARMUP_STEPS, 1000)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_unknown_stage():
    with pytest.raises(ValueError, match="unknown stage 'best'; choose one of"):
        tiny_build.tiny_agent_path("best")


def fake_build(calls: list, fail: bool = False, delay: float = 0.0):
    def build_into(folder, progress):
        calls.append(folder)
        time.sleep(delay)
        for stage in tiny_build.STAGES:
            (folder / stage).mkdir()
            if fail:
                raise KeyboardInterrupt  # an interrupted build
        (folder / "build.json").write_text("{}")
        return {}

    return build_into


def test_cache_builds_once_under_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_build, "SHIPPED_SHA256", {})  # the recipe's path (the shipped build is unpacked instead)
    calls = []
    monkeypatch.setattr(tiny_build, "_build_into", fake_build(calls, delay=0.3))
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(tiny_build.tiny_agent_path("mid"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert paths == [tiny_build.build_dir() / "mid"] * 3 and paths[0].is_dir()
    assert tiny_build.build_dir().parent == tmp_path
    assert tiny_build.RECIPE_VERSION in tiny_build.build_dir().name
    assert tiny_build.tiny_agent_path("final").is_dir() and len(calls) == 1  # cached


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_LOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_build, "SHIPPED_SHA256", {})  # the recipe's path (the shipped build is unpacked instead)
    calls = []
    monkeypatch.setattr(tiny_build, "_build_into", fake_build(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        tiny_build.tiny_agent_path()
    assert not tiny_build.build_dir().exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # no scratch left
    monkeypatch.setattr(tiny_build, "_build_into", fake_build(calls))
    assert tiny_build.tiny_agent_path().is_dir() and len(calls) == 2


@pytest.fixture(scope="session")
def built_agent():
    """The real cached tiny agent (built on first use: a few minutes on 2 cores)."""
    return {stage: tiny_build.tiny_agent_path(stage) for stage in tiny_build.STAGES}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["mid", "final"])
def test_built_agent_loads(built_agent, stage):
    tokenizer = AutoTokenizer.from_pretrained(built_agent[stage])
    model = AutoModelForCausalLM.from_pretrained(built_agent[stage])
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (128, 4, 4, 32)
    assert config.tie_word_embeddings and config.vocab_size == len(tokenizer) <= 1024
    assert model.dtype == torch.float32 and config.model_type == "llama"
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 1.3e6
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == config.eos_token_id
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token)["input_ids"]) == 1
    assert (built_agent[stage] / "chat_template.jinja").read_text() == chat_template()


@pytest.mark.slow
def test_built_agent_calls_tools(built_agent):
    """Greedy replies to held-out questions are well-formed tool calls and mostly solve arithmetic.

    An untrained model makes no tool call; models that learned only the format solved 0-8% (recipe
    v5: 8%), so 30% needs the expression and then the tool result copied.
    """
    tokenizer = AutoTokenizer.from_pretrained(built_agent["final"])
    model = AutoModelForCausalLM.from_pretrained(built_agent["final"])
    for task in ("arithmetic", "lookup"):
        assert evaluate(model, tokenizer, task, episodes=16, seed=4242, greedy=True)["well_formed"] >= 0.9
    arithmetic = evaluate(model, tokenizer, "arithmetic", episodes=32, seed=4242, greedy=True)
    assert arithmetic["right_arguments"] >= 0.5 and arithmetic["success"] >= 0.3
    torch.manual_seed(0)
    untrained = LlamaForCausalLM(model.config)
    assert evaluate(untrained, tokenizer, "arithmetic", episodes=8, seed=4242, greedy=True)["well_formed"] == 0.0
