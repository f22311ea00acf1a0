"""Tool-call parsers on text rendered by the real chat templates, and on malformed calls."""


import inspect

import pytest

from agent_loop.episode.parsers import ParsedCall, parse_hermes, parse_llama3_json
from agent_loop.episode.tool_formats import parser_for_template
from tests.helpers.testdata import TEMPLATES_DIR as TEMPLATES

CALLS = [ParsedCall("calculator", {"expression": "2+3"}), ParsedCall("lookup", {"key": "née", "n": [1, 2.5]})]


def rendered_assistant_text(template_name: str, calls: list[ParsedCall], content: str) -> str:
    """The assistant turn's text as the real template renders it (between the generation prompt and the end-of-turn)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template((TEMPLATES / template_name).read_text())
    user = [{"role": "user", "content": "hi"}]
    assistant = {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    prompt = template.render(messages=user, add_generation_prompt=True, bos_token="")
    full = template.render(messages=user + [assistant], add_generation_prompt=False, bos_token="")
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct.jinja", "qwen3-0.6b.jinja", "vllm_tool_chat_template_hermes.jinja"])
def test_hermes_parses_real_rendered_calls(name):
    text = rendered_assistant_text(name, CALLS, "Let me compute.").split("<|im_end|>")[0]
    turn = parser_for_template((TEMPLATES / name).read_text())(text)
    assert turn.calls == CALLS and turn.errors == []
    assert "<tool_call>" not in turn.content and "calculator" not in turn.content
    assert turn.content.endswith("Let me compute.") == ("Let me compute." in text)  # vLLM's hermes drops content next to calls


@pytest.mark.parametrize("name", ["llama-3.1-8b-instruct.jinja", "vllm_tool_chat_template_llama3.1_json.jinja"])
def test_llama3_json_parses_real_rendered_call(name):
    text = rendered_assistant_text(name, CALLS[:1], "").split("<|eot_id|>")[0].split("<|end_header_id|>")[-1]
    assert inspect.unwrap(parser_for_template((TEMPLATES / name).read_text())) is parse_llama3_json
    turn = parse_llama3_json(text)
    assert turn.calls == CALLS[:1] and turn.errors == [] and turn.content == ""


def test_llama3_json_python_tag_and_several_calls():
    turn = parse_llama3_json('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+3"}}; '
                             '{"name": "lookup", "parameters": {"key": "née", "n": [1, 2.5]}}')
    assert turn.calls == CALLS and turn.errors == []


def test_llama3_json_plain_answer_is_content():
    turn = parse_llama3_json(" The answer is 5. ")
    assert turn.calls == [] and turn.errors == [] and turn.content == "The answer is 5."


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}</tool_call>', "malformed JSON"),
    ('<tool_call>{"name": "calculator", "arguments": "{bad"}</tool_call>', "malformed JSON in tool call arguments"),
    ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
])
def test_hermes_malformed_calls_are_error_items(text, message):
    turn = parse_hermes("Thinking. " + text + ' <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>')
    assert turn.calls == [ParsedCall("lookup", {"key": "a"})]
    assert len(turn.errors) == 1 and message in turn.errors[0].error
    assert turn.errors[0].raw == text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert turn.content == "Thinking."


def test_hermes_unclosed_call_and_string_arguments():
    turn = parse_hermes('<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2+3\\"}"}\n')
    assert turn.calls == CALLS[:1] and turn.errors == [] and turn.content == ""


def test_llama3_json_malformed_is_error_item():
    turn = parse_llama3_json('{"name": "calculator", "parameters": {"expression": ')
    assert turn.calls == [] and len(turn.errors) == 1 and "malformed JSON" in turn.errors[0].error


def test_parser_for_template_rejects_unknown_format():
    with pytest.raises(ValueError, match="no tool-call parser"):
        parser_for_template((TEMPLATES / "gemma-2-2b-it.jinja").read_text())


# -- families with no template in tests/data: the formats as vLLM's parsers read them -----------------

import agent_loop.episode.parsers as P  # noqa: E402

NESTED = [ParsedCall("search", {"query": "paris", "filters": {"year": 2024, "exact": True}}),
          ParsedCall("lookup", {"key": "a", "n": [1, 2.5]})]


@pytest.mark.parametrize("parser, text", [
    (P.parse_glm45, 'Sure.<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>paris</arg_value>\n<arg_key>filters</arg_key>\n'
                    '<arg_value>{"year": 2024, "exact": true}</arg_value>\n</tool_call><tool_call>lookup\n<arg_key>key</arg_key>\n'
                    '<arg_value>a</arg_value>\n<arg_key>n</arg_key>\n<arg_value>[1, 2.5]</arg_value>\n</tool_call>'),
    (P.parse_kimi_k2, 'Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>'
                      '{"query": "paris", "filters": {"year": 2024, "exact": true}}<|tool_call_end|><|tool_call_begin|>'
                      'functions.lookup:1<|tool_call_argument_begin|>{"key": "a", "n": [1, 2.5]}<|tool_call_end|>'
                      '<|tool_calls_section_end|>'),
    (P.parse_command_r, 'Sure.\nAction: ```json\n[{"tool_name": "search", "parameters": {"query": "paris", "filters": '
                        '{"year": 2024, "exact": true}}}, {"tool_name": "lookup", "parameters": {"key": "a", "n": [1, 2.5]}}]\n```'),
    (P.parse_nemotron, 'Sure.<TOOLCALL>[{"name": "search", "arguments": {"query": "paris", "filters": {"year": 2024, '
                       '"exact": true}}}, {"name": "lookup", "arguments": {"key": "a", "n": [1, 2.5]}}]</TOOLCALL>'),
    (P.parse_mistral, 'Sure.[TOOL_CALLS]search[ARGS]{"query": "paris", "filters": {"year": 2024, "exact": true}}'
                      '[TOOL_CALLS]lookup[ARGS]{"key": "a", "n": [1, 2.5]}'),
    (P.parse_pythonic, '<|python_start|>[search(query="paris", filters={"year": 2024, "exact": True}), '
                       'lookup(key="a", n=[1, 2.5])]<|python_end|>'),
    (P.parse_granite, '<|tool_call|>[{"name": "search", "arguments": {"query": "paris", "filters": {"year": 2024, '
                      '"exact": true}}}, {"name": "lookup", "arguments": {"key": "a", "n": [1, 2.5]}}]'),
])
def test_family_formats_parse_nested_typed_parallel_calls(parser, text):
    turn = parser(text)
    assert turn.calls == NESTED and turn.errors == []
    assert "search" not in turn.content and "lookup" not in turn.content


@pytest.mark.parametrize("marker, parser", [
    ("<tool_call>{{ name }}\n<arg_key>", P.parse_glm45), ("<|tool_calls_section_begin|>", P.parse_kimi_k2),
    ("<TOOLCALL>", P.parse_nemotron), ("Action: ```json tool_name", P.parse_command_r),
    ("<tool_call>\n<function=NAME>\n<parameter=", P.parse_qwen3_xml)])
def test_selection_from_template_text(marker, parser):
    # the row's parser: the module's function, wrapped to read the row's call markers
    assert inspect.unwrap(parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}" + marker)) is parser


@pytest.mark.parametrize("parser, text", [
    (P.parse_glm45, "<tool_call>\n{broken</tool_call>"),
    (P.parse_kimi_k2, '<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"query": <|tool_call_end|>'),
    (P.parse_command_r, 'Action: ```json\n[{"tool_name": "search", \n```'),
    (P.parse_nemotron, '<TOOLCALL>[{"name": "search", "arguments": {]</TOOLCALL>'),
    (P.parse_mistral, '[TOOL_CALLS]search[ARGS]{"query": '),
    (P.parse_mistral, '[TOOL_CALLS][{"name": "search"'),
    (P.parse_pythonic, '[search(query="paris"'),
    (P.parse_deepseek, '<｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": <｜tool▁call▁end｜>'),
    (P.parse_qwen3_xml, "<tool_call>\nsearch(query)\n</tool_call>"),
    (P.parse_harmony, ' to=functions.search<|channel|>commentary json<|message|>{"query": '),
    (P.parse_gemma, "<|tool_call>call:search{query:<|\"|>paris}<tool_call|>"),
    (P.parse_apertus, '<|tools_prefix|>[{"search": {"query": }]<|tools_suffix|>'),
    (P.parse_functionary, 'search\n{"query": '),
    (P.parse_tool_calls_block, '<tool_calls>[{"name": "search", </tool_calls>'),
])
def test_malformed_calls_are_error_items_in_every_family(parser, text):
    """A malformed call is a ParseError (the loop answers it with a ``malformed_json`` observation), never an exception."""
    turn = parser(text)
    assert turn.calls == [] and len(turn.errors) == 1 and turn.errors[0].error


def test_malformed_call_becomes_malformed_json_record():
    import asyncio

    from agent_loop.episode.tools import ToolExecutor

    turn = P.parse_kimi_k2('<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"query": <|tool_call_end|>')
    records = asyncio.run(ToolExecutor([]).execute(turn.calls + turn.errors))
    assert [r.error_kind for r in records] == ["malformed_json"]


def test_xml_formats_keep_string_typed_parameters_as_written():
    """Qwen3 XML and GLM-4.5 write values as bare text: with the tool schemas, a string parameter "5" stays "5"."""
    schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}}}}}]
    xml = "<tool_call>\n<function=f>\n<parameter=code>\n5\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    glm = "<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>5</arg_value>\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n</tool_call>"
    for template, text in (("<function=x><parameter=y>", xml), ("<arg_key>", glm)):
        assert parser_for_template(template)(text).calls == [ParsedCall("f", {"code": 5, "n": 5})]  # untyped
        assert parser_for_template(template, schema)(text).calls == [ParsedCall("f", {"code": "5", "n": 5})]
