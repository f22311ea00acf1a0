"""Every template that renders tool calls round-trips through the parser selected from its text, or is listed
with the reason (LOSSY: the template cannot render the calls faithfully; UNPARSED: no parser reads its format, and
``parser_for_template`` refuses it). A rendered call that the parser returns as no call and no error fails every
template, listed or not.

An assistant message with two parallel calls (nested, typed arguments) is rendered through the real
template; the assistant turn's text (after the generation prompt, up to its end-of-turn marker) is
parsed with ``parser_for_template`` and must give the same calls back. Templates that cannot render
these calls faithfully are listed with the reason, and that reason is asserted.
"""

import json

import pytest
from test_chat_templates import CALCULATOR, TEMPLATE_KWARGS, tokenizer  # noqa: F401 (fixture)

from agent_loop.episode.chat import ChatFormatter, TemplateError, end_of_turn_marker, first_difference
from agent_loop.episode.tool_formats import find_tool_format, parser_for_template
from tests.helpers.testdata import TEMPLATE_FILES, read_template

CALLS = [("calculator", {"expression": "2+3", "options": {"precision": 2, "exact": True, "tags": ["a", "b"]}}),
         ("lookup", {"key": 'say "hi"', "limit": 3, "ratio": 2.5, "missing": None})]
ONE_CALL = CALLS[:1]

# Templates whose tool calls do not come back, and why (asserted below).
LOSSY = {
    # the template renders no tool calls at all for an assistant message that has them
    "granite-3.3-2b-instruct.jinja": "renders no tool calls",
    "vllm_tool_chat_template_glm4.jinja": "renders no tool calls",
    # nested argument values are written as a Python repr inside <escape>...<escape>: a string comes back
    "vllm_tool_chat_template_functiongemma.jinja": "Python repr",
    # argument values are written unquoted or as Python reprs inside strings: not recoverable
    "vllm_tool_chat_template_llama3.2_pythonic.jinja": "not valid Python",
    "vllm_tool_chat_template_toolace.jinja": "not valid Python",
    "vllm_tool_chat_template_toolace.d8aae5150bea.jinja": "not valid Python",  # "%sr": an r after every value
    "vllm_tool_chat_template_gemma3_pythonic.jinja": "not valid Python",
    "vllm_tool_chat_template_llama4_pythonic.jinja": "not valid Python",
    # an earlier revision: the same values, and the calls without the list brackets (read, and reported malformed)
    "vllm_tool_chat_template_llama4_pythonic.5a6541db9bfa.jinja": "not valid Python",
    # the arguments are joined without commas ("set first = false" does not outlive its loop iteration)
    "vllm_tool_chat_template_gemma3_pythonic_both.jinja": "not valid Python",
    # object arguments are written with Jinja's string filter: a Python repr inside the XML parameter
    "bytedance-seed-oss.jinja": "Python repr",
    # a turn with calls gets no end-of-turn token: the template's next system turn follows the calls directly
    "command-r-plus-tool_use.jinja": "no end of turn",
    # an earlier revision of vLLM's Hermes template closes the object after the name: {"name": "f"}, "arguments": {...}
    "vllm_tool_chat_template_hermes.f73e0891897f.jinja": "invalid JSON",
    # vLLM's own Jinja filter (tool_response_json_normalize): no render outside vLLM, so no call to read back
    "vllm_tool_chat_template_gemma4.95ed3d757011.jinja": "does not render",
    "vllm_command_r_tool_chat_template.jinja": "no end of turn",
}
# Templates whose call format no parser reads: parser_for_template refuses them (ValueError) instead of choosing a
# parser that would read their calls as no call; the value is the format's own call marker in the template.
UNPARSED = {"gigachat3-10b-a1.8b.jinja": "render_function_call"}


def _calls(formatter, pairs, string_args: bool):
    """The calls as an assistant message holds them, with ids in the family's format (Kimi reads names from them)."""
    return [{"id": formatter.call_id(n, i), "type": "function",
             "function": {"name": n, "arguments": json.dumps(a) if string_args else a}} for i, (n, a) in enumerate(pairs)]


def rendered_turn(formatter: ChatFormatter, pairs, string_args: bool, content, followed: bool = False) -> str:
    """The text of the assistant turn: from where it differs from a plain-text turn (the generation prompt
    may differ from the rendered turn's opening), up to its end-of-turn marker. ``followed``: the calls' results
    after the turn (vLLM's Nemotron JSON templates render the calls of a last assistant message not at all)."""
    head = [{"role": "user", "content": "Compute."}]
    results = [{"role": "tool", "name": n, "tool_call_id": formatter.call_id(n, i), "content": "5"}
               for i, (n, _) in enumerate(pairs)] if followed else []
    full = formatter.render_text(head + [{"role": "assistant", "content": content,
                                          "tool_calls": _calls(formatter, pairs, string_args)}] + results)
    plain = formatter.render_text(head + [{"role": "assistant", "content": "\u2603"}])
    start = first_difference(full, plain[: plain.index("\u2603") + 1])
    offsets = formatter.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    start = next((s for s, e in offsets if s <= start < e), start)  # the start of the token it falls in (<TOOLCALL>)
    tail = formatter.render_text(head, add_generation_prompt=True).rstrip()[-12:]  # a tool-call turn's own header
    if tail and (found := full.find(tail, start, start + 80)) >= 0:
        start = found + len(tail)
    marker = end_of_turn_marker(full, start, len(full), formatter._stop_texts, None, first=True)
    return full[start: marker[0] if marker else len(full)]


def tool_templates():
    return [n for n in TEMPLATE_FILES if "tool_calls" in read_template(n) or "tool_call" in read_template(n)]


@pytest.mark.parametrize("name", tool_templates())
def test_template_tool_calls_round_trip(tokenizer, name):  # noqa: F811
    template = read_template(name)
    if name in UNPARSED:
        assert UNPARSED[name] in template
        with pytest.raises(ValueError, match="no tool-call parser fits this chat template"):
            parser_for_template(template)
        return
    try:
        parser = parser_for_template(template)
    except ValueError:
        pytest.fail(f"{name}: no parser selected")
    kwargs = {"bos_token": ""} | TEMPLATE_KWARGS.get(name, {})
    try:
        formatter = ChatFormatter(tokenizer, tools=[CALCULATOR], chat_template=template, history_mode="keep_seen", **kwargs)
    except TemplateError:  # no end-of-turn token (ChatGLM rounds): the render still shows whether calls come back
        formatter = ChatFormatter.__new__(ChatFormatter)
        formatter.tokenizer, formatter.tools, formatter.chat_template, formatter.template_kwargs = tokenizer, [CALCULATOR], template, kwargs
        formatter._stop_texts, formatter.template_text = {}, template
        formatter.tool_format = find_tool_format(template)
    got, texts = None, []
    attempts = [(followed, pairs, string_args, content)
                for followed in (False, True)  # results after the turn: only where no call rendered without them
                for pairs in (CALLS, ONE_CALL)  # Llama 3.x, harmony: one call per turn
                for string_args in (False, True)  # some templates want JSON-string arguments
                for content in ("", None)]  # the R1 distills render calls only when content is None
    for followed, pairs, string_args, content in attempts:
        if followed and any("calculator" in t for t in texts):
            break
        try:
            text = rendered_turn(formatter, pairs, string_args, content, followed)
        except TemplateError:
            continue
        texts.append(text)
        turn = parser(text)
        got = [(c.name, c.arguments) for c in turn.calls]
        if got == pairs and not turn.errors:
            break
    # every call the turn renders is read, or the turn reports an error: none is dropped silently, not even one of two
    silent = [t for t in texts if not parser(t).errors
              and {n for n in ("calculator", "lookup") if n in t} - {c.name for c in parser(t).calls}]
    assert not silent, f"{name}: a rendered call read as no call and no error: {silent[:1]}"
    if name in LOSSY and LOSSY[name] == "does not render":
        assert got is None and not texts, f"{name} renders now: remove it from LOSSY"
        return
    if name in LOSSY:
        assert got != pairs and texts, f"{name} round-trips now: remove it from LOSSY"
        reason = LOSSY[name]
        if reason == "renders no tool calls":
            assert all("calculator" not in t for t in texts)
        elif reason == "no end of turn":
            assert all("```\n<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>" in t for t in texts) and not got
            assert parser(texts[0]).errors  # read as a malformed call, never as no call
        elif reason == "invalid JSON":
            assert all('"}, "arguments": ' in t for t in texts) and not got
            assert parser(texts[0]).errors  # read as a malformed call, never as no call
        elif reason == "Python repr":
            assert any("{'precision'" in t for t in texts) and got and isinstance(got[0][1]["options"], str)
        else:
            assert any("calculator(" in t for t in texts) and not got
        return
    assert got in (CALLS, ONE_CALL), f"{name}: {parser.__name__} read {got} from {texts[:1]}"
