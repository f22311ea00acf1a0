"""The proxy's request checks and session rules without a server (fast): what is refused and why, how messages
compare, and how a session extends or starts a new segment (a scripted completion drives the session logic)."""

from __future__ import annotations

import pytest

from agent_loop.backends.base import GenerationResult
from agent_loop.episode.loop import formatter_for
from agent_loop.proxy import check_agent_spec
from agent_loop.proxy.agents import load_agent
from agent_loop.proxy.session import Session, message_key
from agent_loop.proxy.wire import ApiError, normal_message, parse_request, wire_message
from masking.kinds import SpanKind

GOOD = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, param", [
    ([1, 2], None), ({"messages": GOOD["messages"]}, "model"), ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "n": 3}, "n"), ({**GOOD, "stop": "x"}, "stop"), ({**GOOD, "top_logprobs": 2}, "top_logprobs"),
    ({**GOOD, "tool_choice": "required"}, "tool_choice"), ({**GOOD, "logit_bias": {"1": 5}}, "logit_bias"),
    ({**GOOD, "response_format": {"type": "json_object"}}, "response_format"),
    ({**GOOD, "temperature": 9}, "temperature"), ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages"),
    ({**GOOD, "tools": [{"type": "function"}]}, "tools"),
])
def test_requests_the_proxy_cannot_honour_are_refused_naming_the_parameter(body, param):
    with pytest.raises(ApiError) as refused:
        parse_request(body)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["message"] == refused.value.message and "\n" not in refused.value.message


def test_messages_are_normalised_as_the_template_renders_them():
    chat = parse_request({**GOOD, "max_completion_tokens": 7, "tool_choice": "none", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}]})
    assert chat.max_tokens == 7 and not chat.parse_tools
    assert chat.messages[0] == {"role": "system", "content": "be brief"}
    assert chat.messages[1]["content"] == "" and chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]  # strict is not prompt text
    sent = wire_message("", [{"id": "c1", "name": "f", "arguments": {"x": 1}}])
    assert sent["content"] is None and sent["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert message_key(normal_message(sent, 0)) == message_key(chat.messages[1])  # echoed back: the same turn
    assert message_key({**chat.messages[1], "content": "edited"}) != message_key(chat.messages[1])


def test_agent_specs_are_checked_before_anything_loads():
    assert check_agent_spec("pkg.mod:fn") == "pkg.mod:fn" and check_agent_spec(None) is None
    for bad in ("nocolon", ":fn", "mod:", "mod:not-a-name"):
        with pytest.raises(ValueError):
            check_agent_spec(bad)
    with pytest.raises(ValueError, match="--agent 'no_such_module_here:fn' does not import"):
        load_agent("no_such_module_here:fn")
    assert callable(load_agent("examples/agents/openai_tools_agent.py:agent"))


def _completion(tokenizer, formatter, text: str) -> GenerationResult:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [formatter.end_of_turn_ids[0]]
    return GenerationResult(ids, [-0.5] * len(ids), "stop")


def test_a_session_extends_token_for_token_and_a_rewrite_starts_a_segment(tiny_tokenizer):
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    formatter = formatter_for(tiny_tokenizer, tools, "keep_seen")
    parse = formatter.tool_format.parser_for(tools)
    session, user = Session("s"), [{"role": "user", "content": "What is 2+3?"}]
    first = session.plan(user, tools, formatter)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls, finish = session.commit(first, _completion(tiny_tokenizer, formatter, call), tiny_tokenizer, parse)
    assert (content, finish, [c["name"] for c in calls]) == ("", "tool_calls", ["calculator"])
    echoed = [*user, normal_message(wire_message(content, calls), 1),
              {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}]
    second = session.plan(echoed, tools, formatter)
    assert not second.new_segment
    assert second.prompt[: first.segment.length] == first.prompt + first.segment.state.response_ids
    session.commit(second, _completion(tiny_tokenizer, formatter, "The answer is 5."), tiny_tokenizer, parse)
    state = session.segments[0].state
    assert state.records[0].result == "5" and state.messages[2]["name"] == "calculator"
    assert [k for k in state.spans if k == SpanKind.OBSERVATION] and state.turn_ids[-1] == 1
    rewritten = [{"role": "user", "content": "What is 2+3? (the tool said 5)"}]  # the agent summarised its history
    third = session.plan(rewritten, tools, formatter)
    assert third.new_segment and third.prompt == formatter.prompt(rewritten)[0]
    session.commit(third, _completion(tiny_tokenizer, formatter, "5"), tiny_tokenizer, parse)
    assert session.counts["rewrites"] == 1 and len(session.segments) == 2
    assert session.plan(rewritten, tools, formatter).new_segment  # the same call again is a retry: a rewrite too
