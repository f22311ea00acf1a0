"""The tool-format table: one row per family, the first whose markers a template holds wins."""

import pytest

from agent_loop.episode.tool_formats import (
    ANY_CALL_MARKERS,
    TOOL_FORMATS,
    default_call_id,
    find_tool_format,
    tool_format_for_template,
)
from tests.helpers.testdata import read_template


def test_rows_are_found_from_the_template_text_first_match_first():
    hermes = find_tool_format(read_template("vllm_tool_chat_template_hermes.jinja"))
    assert hermes.name == "hermes" and hermes.call_markers == ("<tool_call>",)
    # Qwen3-Coder templates also hold "<tool_call>": the more specific XML row comes first and wins
    assert find_tool_format("<tool_call><function=x><parameter=y>").name == "qwen3_xml"
    assert find_tool_format("no tools here") is None
    with pytest.raises(ValueError, match="TOOL_FORMATS"):
        tool_format_for_template("no tools here")


def test_each_row_carries_its_call_ids_stop_tokens_and_schema_typing():
    kimi = find_tool_format("<|tool_calls_section_begin|>")
    assert kimi.make_call_id("lookup", 3) == "functions.lookup:3"
    assert find_tool_format("<tool_call>").make_call_id("lookup", 3) == default_call_id(3) == "call00003"
    assert find_tool_format("<|python_tag|>").stop_tokens == ("<|eom_id|>",)
    xml = find_tool_format("<function=x><parameter=y>")
    schemas = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}}}}}]
    parse = xml.parser_for(schemas)
    text = "<tool_call>\n<function=f>\n<parameter=s>\n7\n</parameter>\n</function>\n</tool_call>"
    assert parse(text).calls[0].arguments == {"s": "7"}  # kept a string, as its schema says
    assert xml.parser(text).calls[0].arguments == {"s": 7}  # without the schemas: typed from the text
    assert all(m in ANY_CALL_MARKERS for row in TOOL_FORMATS for m in row.call_markers)
