"""The tiny agent's tokenizer: byte-level BPE trained on the built-in tasks' dialogues.

The pre-tokenizer isolates every digit, every ``\n`` and every quoted word such as ``"river"``
(docs/platform.md): numbers and expressions are then copied token by token, a lookup key is one and the same
token in the question and in the tool call (and appears nowhere else, so attention finds it by
content), and ``\n`` never merges with the JSON around a tool call. The rest of the text merges
freely, so the template's boilerplate (tool schemas, JSON keys) takes few tokens: a calculator
dialogue is 139 tokens. Special tokens split the text before BPE, so merges never cross a chat turn
boundary and the template stays append-only at the token level.

The folder is saved with ``tokenizer_class: TokenizersBackend`` next to a ``model_type: llama``
config, so ``AutoTokenizer`` (and vLLM) load ``tokenizer.json`` exactly as saved. (For
``model_type: qwen2`` transformers 5 forces ``Qwen2Tokenizer``, which rebuilds Qwen2's own
pre-tokenizer and drops ours; that is why the model is a Llama, see ``train.model_config``.)
"""

import re
from importlib import resources

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# upper bound: the task dialogues support only about 710 pieces, where BPE training stops
VOCAB_SIZE = 1024
# Control tokens (skipped by decode(skip_special_tokens=True)) and, as in Qwen2.5, the tool-call
# markers as plain added tokens that decoding keeps. All come last in the vocabulary, as in Qwen.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL_TOKENS = CONTROL_TOKENS + TOOL_TOKENS
_SPECIAL = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
# pieces that BPE never merges with their neighbours: each digit, each newline, each quoted word
ISOLATED_PIECES = r'\p{N}|\n|"\p{L}+"'


def chat_template() -> str:
    """The Qwen2.5 chat template (Apache-2.0) with a shorter default system prompt."""
    return resources.files("agent_loop.tiny").joinpath("chat_template.jinja").read_text()


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on rendered dialogues and wrap it with the chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(ISOLATED_PIECES), behavior="isolated"),
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
