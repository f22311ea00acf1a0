"""The tiny agent's tokenizer: byte-level BPE trained on the built-in tasks' dialogues.

It uses exactly the normalizer and pre-tokenizer of ``transformers``' ``Qwen2Tokenizer``, because
``AutoTokenizer`` (and so vLLM) always loads a ``model_type: qwen2`` folder with that class, which
rebuilds them; only the vocabulary and merges come from our file. That split keeps digits as single
pieces (numbers are copied digit by digit, FACTS.md) and a lookup key as one word piece that is the
same token in the question and in the tool call. Special tokens split the text before BPE, so merges
never cross a chat turn boundary and the template stays append-only at the token level.
"""

import re
from importlib import resources

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

VOCAB_SIZE = 1024
# Control tokens (skipped by decode(skip_special_tokens=True)) and, as in Qwen2.5, the tool-call
# markers as plain added tokens that decoding keeps. All come last in the vocabulary, as in Qwen.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL_TOKENS = CONTROL_TOKENS + TOOL_TOKENS
_SPECIAL = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


def chat_template() -> str:
    """The Qwen2.5 chat template (Apache-2.0) with a shorter default system prompt."""
    return resources.files("agent_loop.tiny").joinpath("chat_template.jinja").read_text()


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on rendered dialogues and wrap it with the chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # special tokens are atomic: BPE learns only from the text between them
    tokenizer.train_from_iterator((piece for text in texts for piece in _SPECIAL.split(text)), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=token in CONTROL_TOKENS, normalized=False) for token in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template(),
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
