"""ChatFormatter.encode by pieces between added tokens (each piece's ids kept): the same ids as encoding the whole
text, and refused for tokenizers whose parts would not give them."""

import copy
import random

import pytest

from agent_loop.episode import chat
from agent_loop.episode.chat import ChatFormatter

FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
             "<|endoftext|>", "<|im_sta", "rt|>", "<", "|>", "\n", "\n\n", " ", "  ", "\t", "user", "assistant",
             "system\nYou are", ' {"name": "f", "arguments": {"x": 1}}', "hé ✓ 世界", "123456", "'s", "don't",
             "ab", " cd", "\r\n", "</", "tool_call>", "\u2063"]


@pytest.fixture(scope="module")
def formatter(qwen_tokenizer):
    return ChatFormatter(copy.deepcopy(qwen_tokenizer))


def test_pieces_give_the_ids_of_the_whole_text(formatter, qwen_tokenizer):
    """Random texts of special tokens (alone, doubled, cut in half), whitespace and unicode, and real renders: the
    piece-by-piece ids equal ``tokenizer(text)``'s, first while pieces are encoded and again from the kept ones."""
    assert formatter.encoder.splitter is not None  # Qwen2.5 (Split + ByteLevel, NFC, plain added tokens) takes it
    rng = random.Random(0)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12))) for _ in range(400)]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look up.", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": {"key": "x"}}}]},
                {"role": "tool", "name": "lookup", "tool_call_id": "c0", "content": "5\n\n  "}]
    texts += [qwen_tokenizer.apply_chat_template(messages[:n], tools=tools, tokenize=False, add_generation_prompt=True)
              for n in (1, 3)]
    expected = [list(qwen_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    formatter.encoder.pieces.clear()
    assert [formatter.encode(t) for t in texts] == expected
    assert formatter.encoder.pieces  # kept
    assert [formatter.encode(t) for t in texts] == expected  # from the kept pieces


def test_a_full_piece_cache_is_cleared_and_a_new_added_token_ends_the_piece_path(qwen_tokenizer, monkeypatch):
    own = copy.deepcopy(qwen_tokenizer)
    formatter = ChatFormatter(own)
    monkeypatch.setattr(chat, "PIECE_CACHE_SIZE", 3)
    texts = [f"a{i}<|im_end|>b{i}" for i in range(5)]
    assert [formatter.encode(t) for t in texts] == [own(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(formatter.encoder.pieces) <= 3
    own.add_tokens(["zq<x>"])  # the pieces would not split at it: the whole text is encoded
    assert formatter.encode("azq<x>b") == own("azq<x>b", add_special_tokens=False)["input_ids"]
    assert "azq<x>b" not in formatter.encoder.pieces and "a" not in formatter.encoder.pieces


def _tiny(pre_tokenizer, added):
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(["hello world", "the answer is 5", "hello there"] * 20,
                            trainers.BpeTrainer(vocab_size=80, show_progress=False))
    tok.add_tokens(added)
    return tok


def test_tokenizers_whose_pieces_differ_from_the_whole_are_refused():
    """A Metaspace pre-tokenizer that prepends only to the text's first piece (Llama-2/Mistral style) encodes a later
    piece alone otherwise than inside the text: refused, as are added tokens that strip or are normalized, a
    prefix-space ByteLevel and BPE dropout. A plain ByteLevel is taken."""
    from tokenizers import AddedToken, pre_tokenizers

    eot = [AddedToken("<eot>", special=True, normalized=False)]
    meta = _tiny(pre_tokenizers.Metaspace(prepend_scheme="first"), eot)
    text = "hello<eot>hello"
    pieces = meta.encode("hello", add_special_tokens=False).ids
    assert meta.encode(text, add_special_tokens=False).ids != pieces + [meta.token_to_id("<eot>")] + pieces
    assert chat._added_token_splitter(meta) is None
    assert chat._added_token_splitter(_tiny(pre_tokenizers.ByteLevel(add_prefix_space=True), eot)) is None
    strip = [AddedToken("<eot>", special=True, normalized=False, lstrip=True)]
    assert chat._added_token_splitter(_tiny(pre_tokenizers.ByteLevel(add_prefix_space=False), strip)) is None
    normalized = [AddedToken("<eot>", normalized=True)]
    assert chat._added_token_splitter(_tiny(pre_tokenizers.ByteLevel(add_prefix_space=False), normalized)) is None
    plain = _tiny(pre_tokenizers.ByteLevel(add_prefix_space=False), eot)
    assert chat._added_token_splitter(plain) is not None
    plain.model.dropout = 0.5
    assert chat._added_token_splitter(plain) is None
