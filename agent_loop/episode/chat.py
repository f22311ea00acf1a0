"""Token-in, token-out chat formatting (docs/design.md section 4).

The prompt is rendered once with the tokenizer's chat template. Assistant tokens are kept as sampled
and never re-encoded. What follows an assistant turn (tool results, user or environment turns, the
next generation prompt, and the template text after the model's end-of-turn token) is derived from
the *episode's own messages*: the conversation so far plus the new messages is rendered in one go,
the render must start with the text the model has already seen (the previous one-go render, up to
its generation prompt), and the text after the assistant turn's end-of-turn marker is encoded on its
own as the observation. So templates that keep conversation-global state (numbered calls, a flag
set once) are exact by construction, and a template that rewrites earlier text is detected at the
turn where it does (:class:`Observation.mismatch`), never silently wrong.

Exactness is checked on text, and ids are encoded segment by segment as the model saw them: a BPE
merge across the generation prompt (``"\\n"`` + ``"\\n"``) is not a refusal. End of turn: the last
special token of the run the template writes after an assistant's content (``<|eot|><|x|>`` -> ``<|x|>``),
or, for families with none (GLM-4), the next role's token (``<|observation|>``, ``<|user|>``), which
the model samples and which is kept in the assistant span.

Templates that fail the up-front probe (their generation prompt is not how they render the assistant
turn, or appending a message rewrites earlier turns) raise :class:`TemplateError` naming the cause,
unless ``history_mode="keep_seen"``: then the episode keeps the tokens the model saw, the observation
is what the template renders after the episode's own messages, the drift from a fresh render is
recorded, and a warning is given once per formatter.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass

import jinja2

from agent_loop.episode.loop_config import HISTORY_MODES
from agent_loop.episode.tool_formats import default_call_id, find_tool_format

# the formatter's modes: the loop's history modes, and "new_segment" (LoopConfig.context="drop_reasoning"), which runs
# a template that rewrites earlier turns like keep_seen, silently: the loop starts a new segment where it rewrites
FORMATTER_MODES = (*HISTORY_MODES, "new_segment")

# Synthetic text used only to probe the template; the reasoning block keeps templates that render
# reasoning only when it is non-empty (Qwen3) on the same branch before and after the delta.
_SYNTHETIC_SYSTEM = "You are a helpful assistant."
_SYNTHETIC_USER = "What is 2 + 3?"
_SYNTHETIC_REASONING = "I should use a tool."
_SYNTHETIC_CONTENT = "Let me check."
_EOT_PROBE = "The answer is 5."
_SENTINEL = "\u2063\u2063SENTINEL\u2063\u2063"  # marks where a new message's content lands in a render

_KEEP_SEEN_FIX = ("pass history_mode='keep_seen' (LoopConfig.history_mode) to train on the tokens the model saw "
                  "with the drift from a fresh render recorded, or pass chat_template= a template that renders "
                  "append-only")


class TemplateError(ValueError):
    """The chat template cannot be used for token-in, token-out rollouts (or failed to render)."""


@dataclass
class Observation:
    """The tokens to append after an assistant turn, and how they relate to a fresh one-go render.

    ``rendered``: the one-go render of the episode's messages up to and including the next generation
    prompt (pass it to the next :meth:`ChatFormatter.observation`). ``mismatch``: ``None`` when the
    text the model has seen is a prefix of that render; else where they first differ
    (``{"char", "token", "seen", "fresh"}``: offsets in the fresh render and the text around them).
    ``rerender``: ``None`` when that render shows the assistant turn as it was sampled; else where the sampled
    text and the template's text of the turn's recorded message first differ (:func:`turn_difference`).
    """

    ids: list[int]
    rendered: str
    mismatch: dict | None = None
    rerender: dict | None = None


def first_difference(a, b) -> int:
    """Index of the first differing item of two sequences (strings, token lists): the shorter length if
    one is a prefix of the other (also when they are equal)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def turn_difference(sampled: str, rendered: str) -> dict | None:
    """Where the text the model sampled for an assistant turn and the template's text of the turn's recorded
    message first differ (``{"char", "sampled", "rendered"}``: the offset in the turn and the text around it), or
    None when they are the same: a trainer that renders the recorded messages again (verl, TRL, SFT) would
    see other tokens than the model wrote there, e.g. where the parser keeps a field the template renders
    elsewhere, or the model skipped text the template always writes."""
    if sampled == rendered:
        return None
    pos = first_difference(sampled, rendered)
    return {"char": pos, "sampled": sampled[max(0, pos - 40): pos + 40], "rendered": rendered[max(0, pos - 40): pos + 40]}


def assistant_message(text: str, tool_calls: list[dict] | None = None, *, reasoning: str | None = None) -> dict:
    """The chat message of an assistant turn (``tool_calls`` as ``{"name", "arguments"[, "id"]}`` dicts);
    ``reasoning`` (:attr:`ParsedTurn.reasoning`) as its ``reasoning_content``, the field templates that render
    reasoning apart from the content read (Command R7B's plan), as vLLM, verl and TRL name it."""
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [
            {"id": c.get("id", default_call_id(i)), "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for i, c in enumerate(tool_calls)]
    return message


def _plain_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` that ``tokenizer(text)`` only forwards to (transformers' fast tokenizer without
    its own ``__call__``/``_encode_plus``/input mode), or None."""
    backend, cls = getattr(tokenizer, "_tokenizer", None), type(tokenizer)
    if not getattr(tokenizer, "is_fast", False) or type(backend).__module__.split(".")[0] != "tokenizers":
        return None
    plain = (getattr(cls.__call__, "__module__", "") == "transformers.tokenization_utils_base"
             and getattr(cls._encode_plus, "__module__", "") == "transformers.tokenization_utils_tokenizers"
             and not hasattr(tokenizer, "_switch_to_input_mode") and hasattr(tokenizer, "split_special_tokens") and hasattr(backend, "encode_special_tokens"))
    return backend if plain else None


# Tokenizer parts that work on each piece of text between added tokens on its own, so that encoding a text is
# encoding its pieces one by one (tokenizers splits on added tokens first, then normalizes and pre-tokenizes every
# piece apart): per-character normalizers, and regex/byte-level pre-tokenizers that add nothing at a piece's start
# (not Metaspace with prepend_scheme "first", nor a ByteLevel that adds a prefix space).
_PIECEWISE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
_PIECEWISE_PRE_TOKENIZERS = {"Split": lambda c: True, "Digits": lambda c: True,
                             "ByteLevel": lambda c: not c.get("add_prefix_space")}
PIECE_CACHE_SIZE = 4096  # encoded pieces kept per formatter (cleared when full)


def _piecewise(state: bytes | None, allowed: dict) -> bool:
    """Whether a serialized normalizer/pre-tokenizer (its ``__getstate__``) is made only of ``allowed`` parts."""
    if state is None:
        return True

    def ok(part: dict) -> bool:
        if part.get("type") == "Sequence":
            return all(ok(p) for p in part.get("pretokenizers", part.get("normalizers", [])))
        check = allowed.get(part.get("type"))
        return check is not None and check(part)
    return ok(json.loads(state))


def _added_token_splitter(backend) -> tuple[re.Pattern, dict[str, int]] | None:
    """``(pattern, ids)`` that split a text where ``backend`` (a ``tokenizers.Tokenizer``) splits it before
    anything else, at its added tokens (leftmost, longest first, as its matcher does), with each token's id;
    None when encoding the pieces one by one would not give the text's ids: a BPE with dropout or another model,
    a normalizer or pre-tokenizer that is not piecewise (:data:`_PIECEWISE_PRE_TOKENIZERS`), or an added token
    that is normalized or strips/matches whole words."""
    try:
        if type(backend.model).__name__ != "BPE" or backend.model.dropout:
            return None
        if not (_piecewise(backend.normalizer.__getstate__() if backend.normalizer is not None else None,
                           {k: lambda c: True for k in _PIECEWISE_NORMALIZERS})
                and _piecewise(backend.pre_tokenizer.__getstate__() if backend.pre_tokenizer is not None else None,
                               _PIECEWISE_PRE_TOKENIZERS)):
            return None
        added = backend.get_added_tokens_decoder()
    except (AttributeError, TypeError, ValueError):
        return None
    if not added or any(t.normalized or t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None
    ids = {t.content: i for i, t in added.items()}
    return re.compile("|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))), ids


class TokenEncoder:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]``, read straight from a fast tokenizer's backend where
    that call would only forward to it (:func:`_plain_backend`), and there encoded by pieces between added tokens,
    each piece's ids kept (the tools' system text is the same in every episode), where that gives the same ids as
    encoding the whole text (:func:`_added_token_splitter`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = _plain_backend(tokenizer)
        self.splitter = _added_token_splitter(self.backend) if self.backend is not None else None
        # how many added tokens the splitter knows: one added later ends the piece path
        self.splitter_added = len(self.backend.get_added_tokens_decoder()) if self.splitter else None
        self.pieces: dict[str, tuple[int, ...]] = {}  # piece text -> its ids (at most PIECE_CACHE_SIZE)

    def encode(self, text: str) -> list[int]:
        """``tokenizer(text, add_special_tokens=False)["input_ids"]``: taken straight from a fast tokenizer's backend
        when that call would only forward to it (transformers' own ``__call__``/``_encode_plus``, no truncation or
        padding set on the backend, special tokens split as the tokenizer says), which skips transformers' per-call
        wrapping (about half of a prompt's encoding time on the verl loop benchmark); else that call."""
        backend = self.backend
        if (backend is not None and backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == bool(self.tokenizer.split_special_tokens)):
            if (self.splitter is not None and not backend.encode_special_tokens
                    and len(backend.get_added_tokens_decoder()) == self.splitter_added):  # ~4 us; not get_vocab_size (55 ms)
                return self._encode_pieces(text)
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_pieces(self, text: str) -> list[int]:
        """The backend's ids of ``text``, encoded piece by piece between its added tokens (what the backend itself
        does first), each piece's ids kept by its text: the same ids (tests/episode/test_chat_encode_pieces.py)."""
        pattern, added = self.splitter
        pieces, ids, start = self.pieces, [], 0
        for match in (*pattern.finditer(text), None):
            piece = text[start: match.start() if match is not None else len(text)]
            if piece:
                known = pieces.get(piece)
                if known is None:
                    if len(pieces) >= PIECE_CACHE_SIZE:
                        pieces.clear()
                    known = pieces[piece] = tuple(self.backend.encode(piece, add_special_tokens=False).ids)
                ids += known
            if match is not None:
                ids.append(added[match.group()])
                start = match.end()
        return ids


class ChatFormatter:
    """Renders prompts and observations with a chat template, as token ids.

    ``tools`` are JSON schemas (``transformers.utils.get_json_schema`` output) passed to the template;
    ``chat_template`` overrides the tokenizer's; ``history_mode`` is ``"strict"`` (refuse templates that
    are not append-only), ``"keep_seen"`` (run them, recording the drift) or ``"new_segment"`` (run them without a
    warning: the caller starts a new context where one rewrites, :data:`FORMATTER_MODES`); ``template_kwargs`` are
    extra template variables (e.g. ``enable_thinking=False``).

    Its parts: ``encoder`` (:class:`TokenEncoder`), ``probe`` (:class:`TemplateProbe`, the up-front append-only
    check), the stop tokens found once (:func:`find_end_of_turn_ids`) and each observation derived by :func:`observe`.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None, chat_template: str | None = None, *,
                 history_mode: str = "strict", **template_kwargs):
        if history_mode not in FORMATTER_MODES:
            raise ValueError(f"history_mode must be one of {FORMATTER_MODES}, got {history_mode!r}")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.chat_template = chat_template
        self.history_mode = history_mode
        self.template_kwargs = template_kwargs
        self.template_text = chat_template or getattr(tokenizer, "chat_template", None) or ""
        self.tool_format = find_tool_format(self.template_text)  # None: a template without tool calls
        self.probe = TemplateProbe(self)
        self.warned = False  # the keep_seen warning was given (once per formatter)
        # stop_opens_next_turn: True for families whose turn ends on the next role's token (GLM-4)
        self.end_of_turn_ids, self.stop_opens_next_turn = find_end_of_turn_ids(self)
        self._stop_texts = {t: tokenizer.decode([t]) for t in self.end_of_turn_ids}
        self.encoder = TokenEncoder(tokenizer)

    # -- rendering -------------------------------------------------------------------------------

    def render_text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (with the tool schemas)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. dict arguments where the template wants a string
            roles = [m.get("role") for m in messages]
            raise TemplateError(
                f"chat template failed to render messages with roles {roles}: {e}. Check what this template accepts "
                "(some want tool-call arguments as a JSON string, reject content next to tool calls, a system role, "
                "or need template variables: pass them as ChatFormatter keyword arguments), or pass chat_template=") from e

    def encode(self, text: str) -> list[int]:
        """``tokenizer(text, add_special_tokens=False)["input_ids"]``, by the formatter's :class:`TokenEncoder`."""
        return self.encoder.encode(text)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """Token ids of the template's text, encoded as ``apply_chat_template(tokenize=True)`` does."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """The first prompt (ids, text): ``messages`` rendered once, with the tool schemas and the generation prompt."""
        text = self.render_text(messages, add_generation_prompt=True)
        return self.encode(text), text

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.prompt(messages)[0]

    def call_id(self, name: str, index: int) -> str:
        """The id of the episode's ``index``-th tool call (0-based, counted over the whole episode), in the
        tool format's own id format (:attr:`ToolFormat.call_id`)."""
        return self.tool_format.make_call_id(name, index) if self.tool_format else default_call_id(index)

    # -- observations ----------------------------------------------------------------------------

    def observation(self, history: list[dict], seen: str, new_messages: list[dict],
                    stop_id: int | None = None, sampled: str | None = None) -> Observation:
        """What to append after the assistant turn that ends ``history``, derived from the episode's messages.

        ``seen``: the one-go render the model's context came from (the previous :attr:`Observation.rendered`,
        or the prompt text), ending with the generation prompt of that assistant turn. ``stop_id``: the
        end-of-turn token the model sampled; ``None`` if the turn was cut (then the observation starts
        with the template's end-of-turn marker, so the next turn sees a closed assistant turn). ``sampled``:
        the text of the assistant turn as sampled (without its stop token); when the fresh render shows
        the turn exactly so, one render suffices, else the turn's own render (as the last message) is
        compared too, so a template that rewrites the last turn once more messages follow is caught.
        """
        if not new_messages:
            raise ValueError("an observation needs at least one new message")
        self.probe.check(new_messages)
        if self.history_mode == "strict" and (why := self.probe.reused_call_ids(history, new_messages)) is not None:
            raise TemplateError(why)
        return observe(self, history, seen, new_messages, stop_id, sampled)

    def final_mismatch(self, messages: list[dict], seen: str, *, fresh: str | None = None) -> dict | None:
        """Check a finished episode that ends with an assistant turn: the one-go render of ``messages`` must
        start with ``seen`` (the generation prompt the last turn was sampled after); else where they differ.
        ``fresh``: that render, if the caller has it (``render_text(messages)``)."""
        fresh = self.render_text(messages) if fresh is None else fresh
        if fresh.startswith(seen):
            return None
        pos = first_difference(seen, fresh)
        return {"char": pos, "token": len(self.encode(fresh[:pos])),
                "seen": seen[max(0, pos - 40): pos + 40], "fresh": fresh[max(0, pos - 40): pos + 40]}

    def final_rerender(self, messages: list[dict], seen: str, sampled: str, stop_id: int | None, *,
                       fresh: str | None = None) -> dict | None:
        """:func:`turn_difference` of a finished episode's last assistant turn (sampled after the generation prompt
        ``seen``, ended by ``stop_id``) and the one-go render of ``messages`` (``fresh``, if the caller has it);
        None where the render does not start with ``seen`` (:meth:`final_mismatch` says where)."""
        fresh = self.render_text(messages) if fresh is None else fresh
        if not fresh.startswith(seen):
            return None
        marker = end_of_turn_marker(fresh, len(seen), len(fresh), self._stop_texts, stop_id, first=True)
        at = len(seen) + len(sampled)
        if (fresh.startswith(sampled, len(seen))
                and (rendered := other_rendered_stop(fresh, at, self._stop_texts, stop_id)) is not None):
            if self.history_mode == "strict":  # a final answer sampled with <|flush|> (harmony: <|return|>), rendered <|end|>
                raise TemplateError(
                    f"the model ended its turn with {self._stop_texts[stop_id]!r}, which this chat template renders as "
                    f"{rendered!r} once the turn is in the history: the episode's tokens would differ from a render of "
                    "its messages. pass history_mode='keep_seen' (LoopConfig.history_mode) to train on the tokens the "
                    "model saw with the difference recorded, or stop generation only on the template's own end-of-turn "
                    "marker")
            return {"char": len(sampled), "sampled": self._stop_texts[stop_id], "rendered": rendered}
        return turn_difference(sampled, fresh[len(seen): marker[0] if marker else len(fresh)])

    def observation_ids(self, new_messages: list[dict], after_stop: bool = True) -> list[int]:
        """Observation ids after a fixed synthetic conversation (for tests and tools that have no episode).

        The loop uses :meth:`observation` with the episode's own messages instead.
        """
        if not new_messages:
            raise ValueError("observation_ids needs at least one new message")
        history, seen = self.probe.synthetic_history(tool_key(new_messages))
        stop = self.end_of_turn_ids[0] if after_stop else None
        ids = self.observation(history, seen, new_messages, stop_id=stop).ids
        if (why := self.history_dependence(new_messages)) is not None:
            raise TemplateError(f"{why}; observation_ids renders them after a fixed one-round conversation, so it "
                                "cannot give them: use ChatFormatter.observation(history, seen, new_messages) with the "
                                "conversation's own messages, as the loop does (exact for this template)")
        return ids

    def history_dependence(self, new_messages: list[dict]) -> str | None:
        """Why the observation of messages shaped like ``new_messages`` depends on the conversation before them (a
        second round of the same calls renders otherwise than a first: Command R7B numbers results over every call
        of the chat, R1-distill opens its outputs block once), or None. The loop is exact either way (it renders
        the episode's own messages); a fixed synthetic prefix (:meth:`observation_ids`) is not."""
        self.probe.check(new_messages)
        return self.probe.history_dependent.get(probe_key(new_messages))


# -- observations -------------------------------------------------------------------------------

def observe(formatter: ChatFormatter, history: list[dict], seen: str, new_messages: list[dict], stop_id: int | None,
            sampled: str | None = None) -> Observation:
    """:meth:`ChatFormatter.observation` without the up-front probe and the call-id check (the probe itself
    observes): the one-go render of the episode's messages, checked against ``seen``, and the ids after the
    assistant turn's end-of-turn marker."""
    stop_texts = formatter._stop_texts
    fresh = formatter.render_text(list(history) + list(new_messages), add_generation_prompt=True)
    mismatch, before, rerender = None, seen, None
    if fresh.startswith(seen):
        marker = end_of_turn_marker(fresh, len(seen), len(fresh), stop_texts, stop_id, first=True)
        at = len(seen) + len(sampled) if sampled is not None and fresh.startswith(sampled, len(seen)) else None
        if at is not None and (other := other_rendered_stop(fresh, at, stop_texts, stop_id)) is not None:
            marker = (at, at + len(other))  # the turn ends here, with the marker the template writes
            mismatch = {"char": at, "token": len(formatter.encode(fresh[:at])), "seen": stop_texts[stop_id],
                        "fresh": other}
        if marker is not None and sampled is not None:
            rerender = turn_difference(sampled, fresh[len(seen): marker[0]])
        if marker is not None and fresh[len(seen): marker[0]] != sampled:
            alone = formatter.render_text(history)  # the turn as it rendered when it was the last message
            end = end_of_turn_marker(alone, len(seen), len(alone), stop_texts, stop_id, first=True)
            before = alone[: end[1] if end else len(alone)]
    if not fresh.startswith(before):
        pos = first_difference(before, fresh)
        mismatch = {"char": pos, "token": len(formatter.encode(fresh[:pos])),
                    "seen": before[max(0, pos - 40): pos + 40], "fresh": fresh[max(0, pos - 40): pos + 40]}
        marker = end_of_turn_marker(fresh, 0, new_content_start(formatter, history, new_messages, fresh), stop_texts,
                                    stop_id, first=False)
    if marker is None:
        raise TemplateError(
            f"no end-of-turn marker {list(stop_texts.values())} closes the assistant turn in the render "
            f"{fresh[len(seen) if mismatch is None else 0:][-300:]!r}; pass chat_template= a template that "
            "closes assistant turns with a special token")
    start, end = marker
    return Observation(formatter.encode(fresh[end if stop_id is not None else start:]), fresh, mismatch, rerender)


def new_content_start(formatter: ChatFormatter, history: list[dict], new_messages: list[dict], fresh: str) -> int:
    """Where the first new message's content starts in ``fresh`` (a render with it marked differs there)."""
    marked = [dict(m) for m in new_messages]
    marked[0]["content"] = _SENTINEL + str(marked[0].get("content") or "")
    other = formatter.render_text(list(history) + marked, add_generation_prompt=True)
    return first_difference(fresh, other)


def end_of_turn_marker(text: str, lo: int, hi: int, stop_texts: dict[int, str], stop_id: int | None,
                       first: bool) -> tuple[int, int] | None:
    """(start, end) of the end-of-turn marker closing the assistant turn within ``text[lo:hi]``; ``stop_texts``:
    each end-of-turn token's text (:attr:`ChatFormatter.end_of_turn_ids`).

    ``first``: the first marker after ``lo`` (the turn starts at ``lo``); else the last before ``hi``
    (``hi`` is where the new messages' content starts). The model's own stop token ``stop_id`` is preferred.
    """
    texts = [stop_texts[stop_id]] if stop_id in stop_texts else []
    texts += [t for t in stop_texts.values() if t and t not in texts]
    for candidates in (texts[:1], texts):
        found = [(text.find(t, lo, hi), t) if first else (text.rfind(t, lo, hi), t) for t in candidates]
        found = [(i, t) for i, t in found if i >= 0]
        if found:
            i, t = (min if first else max)(found)
            return i, i + len(t)
    return None


def other_rendered_stop(text: str, at: int, stop_texts: dict[int, str], stop_id: int | None) -> str | None:
    """The end-of-turn marker the template writes at ``text[at]``, where a turn ended with the stop token
    ``stop_id``, if it is another marker than that token (a mismatch: the model's context holds its own)."""
    sampled = stop_texts.get(stop_id)
    rendered = next((t for t in stop_texts.values() if t and text.startswith(t, at)), None)
    return rendered if sampled is not None and rendered is not None and rendered != sampled else None


# -- the up-front probe ---------------------------------------------------------------------------

def tool_key(messages: list[dict]) -> tuple:
    """The (name, call id) of each tool message: the synthetic turn before them makes these calls."""
    return tuple((m.get("name"), m.get("tool_call_id")) for m in messages if m.get("role") == "tool")


def probe_key(new_messages: list[dict]) -> tuple:
    """The message structure the probe checks once: the new messages' roles and their tool messages' keys."""
    return tuple(m.get("role") for m in new_messages), tool_key(new_messages)


class TemplateProbe:
    """The formatter's up-front check that its template is append-only for each message structure
    (:func:`probe_key`), played once on a fixed synthetic conversation that ends with an assistant turn making one
    call per tool message (:meth:`synthetic_history`), and the check that a turn's results do not reuse earlier
    call ids where the template looks results up by id. ``probed``: each structure's refusal (None: append-only);
    ``history_dependent``: why a structure's observation depends on the conversation before it (a second round
    renders otherwise than a first); ``synthetic``: the synthetic conversation per tool key (:func:`tool_key`)."""

    def __init__(self, formatter: ChatFormatter):
        self.formatter = formatter
        self.probed: dict[tuple, TemplateError | None] = {}
        self.history_dependent: dict[tuple, str | None] = {}
        self.synthetic: dict[tuple, tuple[list[dict], str]] = {}

    def reused_call_ids(self, history: list[dict], new_messages: list[dict]) -> str | None:
        """Why results answering the last turn's calls would render as answers to earlier calls, or None: their
        call ids are also ids of calls in an earlier turn (ids restarting per turn), and the template finds a
        result's call by its id over the whole chat (Command R7B numbers the result as the first call with that
        id), which renaming the earlier calls shows by changing the new results' text."""
        last = history[-1] if history and history[-1].get("role") == "assistant" else {}
        ids = {c.get("id") for c in last.get("tool_calls") or []}
        earlier = {c.get("id"): n for n, m in enumerate(history[:-1]) for c in m.get("tool_calls") or []}
        reused = [m["tool_call_id"] for m in new_messages
                  if m.get("role") == "tool" and m.get("tool_call_id") in ids and m.get("tool_call_id") in earlier]
        if not reused:
            return None
        fresh = {cid: f"dup{k:06d}" for k, cid in enumerate(reused)}  # 9 alphanumerics, as Mistral wants ids
        renamed = [{**m, "tool_calls": [{**c, "id": fresh.get(c.get("id"), c.get("id"))} for c in m["tool_calls"]]}
                   if m.get("tool_calls") else {**m, "tool_call_id": fresh[m["tool_call_id"]]}
                   if m.get("role") == "tool" and m.get("tool_call_id") in fresh else m for m in history[:-1]]
        render = self.formatter.render_text
        try:
            given, other = (render(h + [last] + list(new_messages), True) for h in (list(history[:-1]), renamed))
        except TemplateError:
            return None
        for cid, new_id in fresh.items():  # where the template writes ids themselves (Mistral), write them back
            other = other.replace(new_id, cid)
        if given == other:
            return None  # the template does not look results up by id across turns: harmless
        turns = sorted({earlier[cid] for cid in reused})
        return (f"tool call id(s) {reused} of the last turn are also ids of calls in earlier messages {turns}, and this "
                "chat template finds a result's call by its id over the whole chat: the results would render as "
                "answers to the earlier calls (Command R7B numbers them as those calls). Give every call an id "
                "unique in the conversation (the loop does: ChatFormatter.call_id counts over the episode; a tool "
                "message's tool_call_id is its ToolCallRecord.call_id)")

    def check(self, new_messages: list[dict]) -> None:
        """Check once per message structure that the template is append-only for it (strict mode: raise)."""
        key = probe_key(new_messages)
        if key not in self.probed:
            self.probed[key] = None  # the probe itself calls observation(): do not recurse
            try:
                self.probed[key] = self._error(new_messages)
            except TemplateError as e:
                self.probed[key] = e
        error = self.probed[key]
        if error is None:
            return
        formatter = self.formatter
        if formatter.history_mode == "strict":
            raise error
        if not formatter.warned and formatter.history_mode == "keep_seen":
            formatter.warned = True
            warnings.warn(f"history_mode='keep_seen': {error.args[0].split('. ')[0]}; episodes keep the tokens the "
                          "model saw and record the drift from a fresh render (Trajectory.metrics['template_drift'])",
                          stacklevel=3)

    def _error(self, new_messages: list[dict]) -> TemplateError | None:
        """Why the template is not append-only for messages like ``new_messages`` after the synthetic conversation
        (their render rewrites earlier text, the generation prompt after them is not how the next turn renders, or
        a second round rewrites the first), or None."""
        formatter, roles = self.formatter, [m.get("role") for m in new_messages]
        history, seen = self.synthetic_history(tool_key(new_messages))
        got = observe(formatter, history, seen, new_messages, stop_id=formatter.end_of_turn_ids[0])
        if got.mismatch is not None:
            return TemplateError(
                f"chat template is not append-only: appending messages with roles {roles} rewrites the earlier "
                f"text at character {got.mismatch['char']}: before {got.mismatch['seen']!r}, after "
                f"{got.mismatch['fresh']!r} (it drops or rewrites earlier turns, e.g. their reasoning). {_KEEP_SEEN_FIX}")
        answered = formatter.render_text(history + list(new_messages) + [{"role": "assistant", "content": _EOT_PROBE}])
        if not answered.startswith(got.rendered):
            pos = first_difference(got.rendered, answered)
            return TemplateError(
                f"chat template is not append-only: the generation prompt after messages with roles {roles} is not "
                f"how the next assistant turn renders (at character {pos}: generation prompt "
                f"{got.rendered[max(0, pos - 40): pos + 20]!r}, rendered turn {answered[max(0, pos - 40): pos + 20]!r}). "
                f"{_KEEP_SEEN_FIX}")
        return self._second_round_error(history, seen, new_messages, got)

    def _second_round_error(self, history: list[dict], seen: str, new_messages: list[dict],
                            first: Observation) -> TemplateError | None:
        """Play a second round of the same calls and results (new ids) after the first: a template whose state
        over the conversation rewrites the first round once a second follows (tool results numbered by a count
        of the whole chat, say) is append-only for one round and not for two; one-go and incremental differ.
        Where it only appends, the second round's observation is compared with the same round rendered as the
        first (after ``seen``, the synthetic generation prompt): a difference is recorded in ``history_dependent``
        (:meth:`ChatFormatter.history_dependence`)."""
        formatter, stop_id = self.formatter, self.formatter.end_of_turn_ids[0]
        calls = history[-1].get("tool_calls") or []
        offset = len(calls)
        renamed = {c["id"]: formatter.call_id(c["function"]["name"], offset + i) for i, c in enumerate(calls)}
        again = {**history[-1], "tool_calls": [{**c, "id": renamed[c["id"]]} for c in calls]} if calls else history[-1]
        results = [{**m, "tool_call_id": renamed.get(m.get("tool_call_id"), m.get("tool_call_id"))}
                   if m.get("role") == "tool" and "tool_call_id" in m else m for m in new_messages]
        got = observe(formatter, list(history) + list(new_messages) + [again], first.rendered, results, stop_id=stop_id)
        roles = [m.get("role") for m in new_messages]
        if got.mismatch is None:
            alone = observe(formatter, list(history[:-1]) + [again], seen, results, stop_id=stop_id)
            if alone.ids != got.ids:
                second, one = formatter.tokenizer.decode(got.ids), formatter.tokenizer.decode(alone.ids)
                pos = first_difference(second, one)
                self.history_dependent[probe_key(new_messages)] = (
                    f"the observation of messages with roles {roles} depends on the conversation before it: after a "
                    f"first round of the same calls it renders {second[max(0, pos - 30): pos + 30]!r} where the "
                    f"round as the chat's first renders {one[max(0, pos - 30): pos + 30]!r} (state kept over the whole "
                    "chat, e.g. tool results numbered over every call of the chat)")
            return None
        return TemplateError(
            f"chat template is not append-only across rounds: a second round of messages with roles {roles} rewrites "
            f"the first round's text at character {got.mismatch['char']}: before {got.mismatch['seen']!r}, after "
            f"{got.mismatch['fresh']!r} (state kept over the whole conversation, e.g. tool results numbered by a "
            f"count of the chat, changes text the model has already seen). {_KEEP_SEEN_FIX}")

    def synthetic_history(self, key: tuple) -> tuple[list[dict], str]:
        """A fixed conversation ending in an assistant turn that made one call per tool message of ``key``,
        and the render the model would have seen before that turn (its generation prompt).

        Templates that check that tool results answer the preceding calls (Mistral) need matching calls.
        """
        if key not in self.synthetic:
            formatter = self.formatter
            calls = [{"id": call_id or formatter.call_id(name or "tool", i), "type": "function",
                      "function": {"name": name or "tool", "arguments": {}}}
                     for i, (name, call_id) in enumerate(key)]
            head = self._synthetic_head()
            seen = formatter.render_text(head, add_generation_prompt=True)
            assistant, turn = self._render_synthetic_turn(head, calls)
            if not turn.startswith(seen) and formatter.history_mode == "strict":
                pos = first_difference(seen, turn)
                raise TemplateError(
                    "chat template is not append-only: its generation prompt is not how it renders the assistant "
                    f"turn after the generation prompt (at character {pos}: generation prompt "
                    f"{seen[max(0, pos - 40):]!r}, rendered turn {turn[max(0, pos - 40): pos + 40]!r}). {_KEEP_SEEN_FIX}")
            self.synthetic[key] = (head + [assistant], seen)
        return self.synthetic[key]

    def _synthetic_head(self) -> list[dict]:
        """A system and a user message, or only the user message where the template rejects a system role."""
        system, user = {"role": "system", "content": _SYNTHETIC_SYSTEM}, {"role": "user", "content": _SYNTHETIC_USER}
        try:
            self.formatter.render_text([system, user], add_generation_prompt=True)
            return [system, user]
        except TemplateError:
            return [user]

    def _render_synthetic_turn(self, head: list[dict], calls: list[dict]) -> tuple[dict, str]:
        """The synthetic assistant turn (with reasoning, text and ``calls``) and the render ending with it.

        Falls back to empty content where the template rejects content next to tool calls (Mistral v3),
        and to JSON-string arguments where it wants strings (Functionary, FireFunction).
        """
        contents = [f"<think>\n{_SYNTHETIC_REASONING}\n</think>\n\n{_SYNTHETIC_CONTENT}"] + ([""] if calls else [])
        string_args = [{**c, "function": {**c["function"], "arguments": "{}"}} for c in calls]
        attempts = [(content, c) for c in (calls, string_args) for content in contents]
        for n, (content, turn_calls) in enumerate(attempts):
            assistant = {"role": "assistant", "content": content, **({"tool_calls": turn_calls} if turn_calls else {})}
            try:
                return assistant, self.formatter.render_text(head + [assistant])
            except TemplateError:
                if n == len(attempts) - 1:
                    raise


# -- end of turn ---------------------------------------------------------------------------------

def _specials_after(tokenizer, special_ids: set[int], text: str, end: int,
                    lo: int = 0) -> tuple[list[int], set[int]]:
    """The run of adjacent special tokens that starts with the first special token at or after ``end``, and the
    special tokens of ``text[lo:end]`` but its first (which closes the message before ``lo``); ``special_ids``: the
    tokenizer's special and added tokens."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    run, last_end, before = [], None, []
    for tid, (s, e) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if s < end:
            if s >= lo and tid in special_ids:
                before.append(tid)
            continue
        if tid in special_ids and (last_end is None or s == last_end):
            run.append(tid)
            last_end = e
        elif run:
            break
    return run, set(before[1:])


def _check_eos_text(formatter: ChatFormatter, text: str, end: int, run: list[int]) -> None:
    """Refuse a template that closes an assistant turn with its ``eos_token`` text (``</s>``) where this tokenizer
    does not encode that text as a special token: generation cannot stop on it, and the next special token
    (``[TOOL_RESULTS]``) would be taken for the end of the turn, with the text before it lost or repeated."""
    tokenizer = formatter.tokenizer
    eos = formatter.template_kwargs.get("eos_token", tokenizer.eos_token)
    gap = text[end: text.find(tokenizer.decode(run[:1]), end) if run else len(text)]
    if isinstance(eos, str) and eos and eos in gap:
        raise TemplateError(
            f"this chat template ends an assistant turn with its eos_token {eos!r}, which this tokenizer does not "
            f"encode as one special token (its eos_token is {tokenizer.eos_token!r}), so generation cannot "
            "stop on it; use the model's own tokenizer, or add that marker with tokenizer.add_special_tokens")


def find_end_of_turn_ids(formatter: ChatFormatter) -> tuple[list[int], bool]:
    """The formatter's stop tokens: the last of the special tokens right after an assistant's content (plus eos and
    ``<|eom_id|>``); for families that write none, the tokens that open the next user or tool turn. And whether
    the turn ends on such an opening token (:attr:`ChatFormatter.stop_opens_next_turn`: GLM-4)."""
    tokenizer = formatter.tokenizer
    special_ids = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    opens_next_turn = False
    head = [{"role": "user", "content": _SYNTHETIC_USER}]
    assistant = {"role": "assistant", "content": _EOT_PROBE}
    text = formatter.render_text(head + [assistant])
    end = text.rindex(_EOT_PROBE) + len(_EOT_PROBE)
    run, openers = _specials_after(tokenizer, special_ids, text, end,
                                   lo=text.rindex(_SYNTHETIC_USER) + len(_SYNTHETIC_USER))
    _check_eos_text(formatter, text, end, run)
    # the turn ends with the last of the run (<|END_RESPONSE|><|END_OF_TURN_TOKEN|>), up to where the run opens
    # the next turn (a token that also opened this one after the user's closing token, e.g.
    # <|eot_id|><|start_header_id|> from templates that always add the header)
    closing = next((run[:k] for k in range(1, len(run)) if run[k] in openers), run)
    ids = closing[-1:]
    if not ids:  # GLM-4 style: the model ends its turn by opening the next one
        followers = [[{"role": "user", "content": _SYNTHETIC_USER}]]
        if formatter.tools:
            followers.append([{"role": "tool", "name": "tool", "tool_call_id": formatter.call_id("tool", 0),
                               "content": "5"}])
        for follower in followers:
            try:
                following = formatter.render_text(head + [assistant] + follower)
            except TemplateError:
                continue
            if following.startswith(text):
                ids += [t for t in _specials_after(tokenizer, special_ids, following, len(text))[0][:1] if t not in ids]
        opens_next_turn = bool(ids)
    if not ids:
        after = text[end:end + 20] or formatter.render_text(head + [assistant, head[0]])[end:end + 20]
        raise TemplateError(
            f"no special token ends an assistant turn of this template: its content is followed by {after!r}, "
            "which this tokenizer does not encode as a special token, so generation cannot stop on it; add that "
            "marker with tokenizer.add_special_tokens, or pass chat_template= a template whose turns end (or "
            "the next turn opens) with a special token")
    extra = [tokenizer.eos_token_id]
    # the end of a turn that expects a tool result, in the formats that render results inside the model's
    # turn, opened by a token the model writes (ToolFormat.stop_tokens: Llama 3.1, harmony, Apertus, Gemma 4)
    for token in formatter.tool_format.stop_tokens if formatter.tool_format else ():
        if token in formatter.template_text:
            extra.append(tokenizer.convert_tokens_to_ids(token))
    ids += [t for t in extra if t is not None and t != tokenizer.unk_token_id and t not in ids]
    return ids, opens_next_turn
