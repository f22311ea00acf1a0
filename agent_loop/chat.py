"""Token-in, token-out chat formatting (docs/design.md section 4).

The prompt is rendered once with the tokenizer's chat template. Assistant tokens are kept as sampled
and never re-encoded. What follows an assistant turn (tool results, user or environment turns, the
next generation prompt, and the template tokens after the model's end-of-turn token) is the
template's *delta*: a fixed synthetic conversation is rendered with and without the new messages,
the longer render must start with the shorter one token for token, and the suffix is the
observation. Templates that rewrite earlier turns (e.g. drop the reasoning of earlier assistant
turns) fail that check with a :class:`TemplateError` instead of silently desynchronising.
"""

from __future__ import annotations

import jinja2

# Synthetic text used only to probe the template; the reasoning block keeps templates that render
# reasoning only when it is non-empty (Qwen3) on the same branch before and after the delta.
_SYNTHETIC_SYSTEM = "You are a helpful assistant."
_SYNTHETIC_USER = "What is 2 + 3?"
_SYNTHETIC_REASONING = "I should use a tool."
_SYNTHETIC_CONTENT = "Let me check."
_EOT_PROBE = "The answer is 5."


class TemplateError(ValueError):
    """The chat template cannot be used for token-in, token-out rollouts (or failed to render)."""


class ChatFormatter:
    """Renders prompts and observation deltas with a chat template, as token ids.

    ``tools`` are JSON schemas (``transformers.utils.get_json_schema`` output) passed to the template;
    ``chat_template`` overrides the tokenizer's; ``template_kwargs`` are extra template variables
    (e.g. ``enable_thinking=False``).
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None, chat_template: str | None = None,
                 **template_kwargs):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self._special_ids = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        self._prefix_cache: dict[tuple, tuple[list[dict], list[int]]] = {}
        self._checked_structures: set[tuple] = set()
        self.end_of_turn_ids: list[int] = self._find_end_of_turn_ids()

    # -- rendering -------------------------------------------------------------------------------

    def render_text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (with the tool schemas)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. dict arguments where the template wants a string
            roles = [m.get("role") for m in messages]
            raise TemplateError(f"chat template failed to render messages with roles {roles}: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """Token ids of the template's text, encoded as ``apply_chat_template(tokenize=True)`` does."""
        text = self.render_text(messages, add_generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: ``messages`` rendered once, with the tool schemas and the generation prompt."""
        return self.render(messages, add_generation_prompt=True)

    def observation_ids(self, new_messages: list[dict], after_stop: bool = True) -> list[int]:
        """Tokens to append after an assistant turn, up to and including the next generation prompt.

        ``new_messages``: what follows the assistant turn (tool results, user or environment turns).
        ``after_stop=True``: the turn ended on the model's end-of-turn token; the observation starts
        with the template tokens that follow that token (e.g. the ``"\\n"`` after ``<|im_end|>``).
        ``after_stop=False``: the turn was cut (e.g. ``max_tokens``); the observation also starts with
        the template's end-of-turn token, so the next turn sees a closed assistant turn.
        Raises :class:`TemplateError` if appending the messages changes the rendered prefix.
        """
        if not new_messages:
            raise ValueError("observation_ids needs at least one new message")
        prefix_messages, prefix_ids = self._synthetic_prefix(new_messages)
        conversation = prefix_messages + list(new_messages)
        full = self.render(conversation, add_generation_prompt=True)
        roles = [m.get("role") for m in new_messages]
        self._check_prefix(prefix_ids, full, what=f"appending messages with roles {roles}")
        structure = (tuple(roles), self._tool_key(new_messages))
        if structure not in self._checked_structures:
            # the generation prompt after these messages must also be how the next assistant turn renders
            answered = self.render(conversation + [{"role": "assistant", "content": _EOT_PROBE}])
            self._check_prefix(full, answered, what=f"rendering the next assistant turn after messages with roles {roles}")
            self._checked_structures.add(structure)
        delta = full[len(prefix_ids):]
        return delta if after_stop else [prefix_ids[-1], *delta]

    @staticmethod
    def assistant_message(text: str, tool_calls: list[dict] | None = None) -> dict:
        """The chat message of an assistant turn (``tool_calls`` as ``{"name", "arguments"}`` dicts), for records."""
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = [
                {"id": c.get("id", f"call{i:05d}"), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for i, c in enumerate(tool_calls)]
        return message

    # -- the synthetic prefix --------------------------------------------------------------------

    def _synthetic_prefix(self, new_messages: list[dict]) -> tuple[list[dict], list[int]]:
        """A fixed conversation ending in an assistant turn that made one call per new tool message.

        Returns the messages and their ids up to and including the end-of-turn token of that turn.
        Cached per (name, tool_call_id) of the new tool messages: templates that check that tool
        results answer the preceding calls (Mistral) need matching calls. The generation prompt must
        be a prefix of the rendered turn.
        """
        key = self._tool_key(new_messages)
        if key not in self._prefix_cache:
            calls = [{"id": call_id or f"call{i:05d}", "type": "function",
                      "function": {"name": name or "tool", "arguments": {}}}
                     for i, (name, call_id) in enumerate(key)]
            head = self._synthetic_head()
            generation_prompt = self.render(head, add_generation_prompt=True)
            with_turn = self._render_synthetic_turn(head, calls)
            self._check_prefix(generation_prompt, with_turn[1],
                               what="rendering the assistant turn after the generation prompt")
            eot = self._first_end_of_turn(with_turn[1], start=len(generation_prompt))
            self._prefix_cache[key] = (head + [with_turn[0]], with_turn[1][: eot + 1])
        return self._prefix_cache[key]

    @staticmethod
    def _tool_key(messages: list[dict]) -> tuple:
        return tuple((m.get("name"), m.get("tool_call_id")) for m in messages if m.get("role") == "tool")

    def _synthetic_head(self) -> list[dict]:
        """A system and a user message, or only the user message where the template rejects a system role."""
        user = {"role": "user", "content": _SYNTHETIC_USER}
        try:
            self.render_text([{"role": "system", "content": _SYNTHETIC_SYSTEM}, user], add_generation_prompt=True)
            return [{"role": "system", "content": _SYNTHETIC_SYSTEM}, user]
        except TemplateError:
            return [user]

    def _render_synthetic_turn(self, head: list[dict], calls: list[dict]) -> tuple[dict, list[int]]:
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
                return assistant, self.render(head + [assistant])
            except TemplateError:
                if n == len(attempts) - 1:
                    raise

    def _first_end_of_turn(self, ids: list[int], start: int) -> int:
        for i in range(start, len(ids)):
            if ids[i] in self.end_of_turn_ids:
                return i
        raise TemplateError(
            f"no end-of-turn token {self.end_of_turn_ids} closes the synthetic assistant turn: "
            f"{self.tokenizer.decode(ids[start:])!r}")

    def _check_prefix(self, before: list[int], after: list[int], what: str) -> None:
        """Strict append-only check: ``after`` must start with ``before``, token for token."""
        if after[: len(before)] == before:
            return
        pos = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        lo = max(0, pos - 8)
        raise TemplateError(
            f"chat template is not append-only: {what} changes the rendered prefix at token {pos}: "
            f"before {self.tokenizer.decode(before[lo: pos + 12])!r}, after {self.tokenizer.decode(after[lo: pos + 12])!r}. "
            "The template rewrites earlier turns (for example it drops the reasoning of earlier assistant turns, "
            "or its generation prompt is not how it renders the assistant turn); token-in/token-out rollouts "
            "need an append-only template.")

    def _find_end_of_turn_ids(self) -> list[int]:
        """The special token the template puts right after an assistant's content, plus eos and ``<|eom_id|>``."""
        head = [{"role": "user", "content": _SYNTHETIC_USER}]
        text = self.render_text(head + [{"role": "assistant", "content": _EOT_PROBE}])
        end = text.rindex(_EOT_PROBE) + len(_EOT_PROBE)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        eot = next((tid for tid, (s, _) in zip(encoded["input_ids"], encoded["offset_mapping"])
                    if s >= end and tid in self._special_ids), None)
        if eot is None:
            raise TemplateError(
                f"the template's end-of-turn marker {text[end:end + 20]!r} is not a special token of this tokenizer; "
                "add it with tokenizer.add_special_tokens so generation can stop on it")
        ids = [eot]
        extra = [self.tokenizer.eos_token_id]
        template = self.chat_template or self.tokenizer.chat_template or ""
        if "<|eom_id|>" in template:  # Llama 3.1: end of a turn that expects a tool result
            extra.append(self.tokenizer.convert_tokens_to_ids("<|eom_id|>"))
        ids += [t for t in extra if t is not None and t != self.tokenizer.unk_token_id and t not in ids]
        return ids
