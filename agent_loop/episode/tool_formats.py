"""Tool-call formats: everything the loop knows about a family's way of calling tools, one table row each.

A row says how to recognise the format in a chat template (``markers``), how to read the model's calls
(``parser``), the format's own markers in the model's text (``call_markers``, declared here only: the
final-answer rule asks them, :func:`agent_loop.tasks.rewards.final_answer`, and the row's parser reports a
turn that holds one but yields no call as a malformed call, :func:`agent_loop.episode.parsers.reading_markers`), which extra tokens end a turn that expects a tool
result (``stop_tokens``, where the template writes them), and the format of tool-call ids
(``call_id``). Adding a format: its parser in :mod:`agent_loop.episode.parsers` and one row in
:data:`TOOL_FORMATS` (the first row whose markers the template holds wins, so specific rows come first).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import agent_loop.episode.parsers as p


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call format (see the module docstring)."""

    name: str
    markers: tuple[tuple[str, ...], ...]  # alternatives; each is a set of strings the template text holds
    parser: Callable[..., p.ParsedTurn]
    call_markers: tuple[str, ...] = ()  # the format's own call text (opening, closing, quoting) in the model's output
    stop_tokens: tuple[str, ...] = ()  # tokens that end a turn awaiting a tool result (where the template has them)
    call_id: str = "call{index:05d}"  # the episode's index-th call (0-based); 9 alphanumerics, as Mistral requires
    schema_typed: bool = False  # values are written as bare text: the parser needs the schemas for string types

    def __post_init__(self):  # the parser reads this row's call markers: one declaration for both uses
        parse = self.parser.__wrapped__ if hasattr(self.parser, "call_markers") else self.parser  # not twice
        object.__setattr__(self, "parser", p.reading_markers(parse, self.call_markers))

    def matches(self, template: str) -> bool:
        return any(all(m in template for m in alternative) for alternative in self.markers)

    def parser_for(self, tools: list[dict] | None = None) -> Callable[[str], p.ParsedTurn]:
        """The parser; for schema-typed formats with ``tools`` (JSON schemas), one that keeps string-typed
        parameters as strings."""
        return functools.partial(self.parser, schemas=tools) if self.schema_typed and tools else self.parser

    def make_call_id(self, name: str, index: int) -> str:
        return self.call_id.format(name=name, index=index)


TOOL_FORMATS: list[ToolFormat] = [
    ToolFormat("kimi_k2", (("<|tool_calls_section_begin|>",),), p.parse_kimi_k2,
               ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
               call_id="functions.{name}:{index}"),  # vLLM's Kimi parser reads the name from the id
    ToolFormat("deepseek", (("<｜tool▁call▁begin｜>",),), p.parse_deepseek, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")),
    ToolFormat("minimax_m2", (("<minimax:tool_call>",),), p.parse_minimax_m2, ("<minimax:tool_call>", "<invoke name="),
               schema_typed=True),
    ToolFormat("deepseek_v32", (("｜DSML｜", "function_calls>"),), p.parse_deepseek_v32,
               ("<｜DSML｜function_calls>", "<｜DSML｜invoke"), schema_typed=True),
    ToolFormat("muse_glimmer", (("<atem:function_calls>",),), p.parse_muse_glimmer,
               ("<atem:function_calls>", "<atem:invoke"), schema_typed=True),
    ToolFormat("seed_oss", (("<seed:tool_call>",),), p.parse_seed_oss, ("<seed:tool_call>", "<function="), schema_typed=True),
    ToolFormat("qwen3_xml", (("<function=", "<parameter="),), p.parse_qwen3_xml, ("<tool_call>", "<function="),
               schema_typed=True),
    ToolFormat("functionary_v31", (("<function=", "</function>", "<|start_header_id|>"),), p.parse_functionary_v31,
               ("<function=",), ("<|eom_id|>",)),
    ToolFormat("glm45", (("<arg_key>",),), p.parse_glm45, ("<tool_call>", "<arg_key>"), schema_typed=True),
    ToolFormat("hermes", (("<tool_call>",),), p.parse_hermes, ("<tool_call>",)),
    ToolFormat("mistral", (("[TOOL_CALLS]",),), p.parse_mistral, ("[TOOL_CALLS]",)),
    ToolFormat("nemotron", (("<TOOLCALL>",),), p.parse_nemotron, ("<TOOLCALL>",)),
    ToolFormat("granite", (("<|tool_call|>",),), p.parse_granite, ("<|tool_call|>",)),
    ToolFormat("granite_20b_fc", (("<function_call>",),), p.parse_granite_20b_fc, ("<function_call>",)),
    ToolFormat("internlm2", (("<|action_start|>",),), p.parse_internlm2, ("<|action_start|>",)),
    ToolFormat("tool_calls_block", (("<tool_calls>",),), p.parse_tool_calls_block, ("<tool_calls>",)),
    ToolFormat("apertus", (("<|tools_prefix|>",),), p.parse_apertus, ("<|tools_prefix|>",), ("<|tools_suffix|>",)),
    ToolFormat("solar_open", (("<|tool_call:begin|>",),), p.parse_solar_open, ("<|tool_calls|>", "<|tool_call:begin|>"),
               ("<|calls|>",)),
    ToolFormat("minicpm3", (("<|tool_call_start|>", "```python"),), p.parse_minicpm3, ("<|tool_call_start|>",)),
    ToolFormat("olmo3", (("<function_calls>",),), p.parse_olmo3, ("<function_calls>",)),
    ToolFormat("lfm2", (("<|tool_call_start|>",), ("<|tool_list_start|>",), ("List of tools: [",)), p.parse_lfm2, ("<|tool_call_start|>",)),
    ToolFormat("harmony", (("<|call|>", "<|channel|>"),), p.parse_harmony, ("to=functions.",), ("<|call|>",)),
    ToolFormat("gemma", (("<|tool_call>",), ("<start_function_call>",)), p.parse_gemma,
               ("<|tool_call>", "<start_function_call>", "<tool_call|>", "<end_function_call>", '<|"|>', "<escape>"),
               ("<|tool_response>",)),
    ToolFormat("functools", (("functools",),), p.parse_functools, ("functools[",)),
    ToolFormat("functionary", ((">>>all",),), p.parse_functionary),
    ToolFormat("command_r", (("<|START_ACTION|>",), ("Action:", "tool_name")), p.parse_command_r,
               ("<|START_ACTION|>", "Action:")),
    ToolFormat("llama3_json", (("<|python_tag|>",),), p.parse_llama3_json, ("<|python_tag|>",), ("<|eom_id|>",)),
    ToolFormat("pythonic", (("[func_name",),), p.parse_pythonic, ("<|python_start|>",), ("<|eom|>",)),
    ToolFormat("xlam", (('[{"name": "tool_call_name"',),), p.parse_xlam),
    ToolFormat("hyperclovax", (("-> tool/function_call",),), p.parse_hyperclovax, ("-> tool/function_call",),
               ("<|stop|>",)),
    ToolFormat("llama3_json", (("<|start_header_id|>", "parameters"), ("<|header_start|>", "parameters")),
               p.parse_llama3_json, ("<|python_tag|>", "<|python_start|>"), ("<|eom_id|>",)),
    # last: Hermes-style templates also hold these, and match the hermes row first
    ToolFormat("tools_tag", (("<tools>", "</tools>", "<tool_response>"),), p.parse_tools_tag, ("<tools>",)),
]

def parse_plain(text: str) -> p.ParsedTurn:
    """A turn of an episode without tools under a template without tool calls: all of it is the answer."""
    return p.ParsedTurn(text.strip())


# episodes without tools under a template that renders no tool calls (the loop picks it; no template matches it)
NO_TOOLS = ToolFormat("none", (), parse_plain)

# what opens a call in any format: the final-answer rule for an episode whose format is unknown
ANY_CALL_MARKERS = tuple(dict.fromkeys(m for f in TOOL_FORMATS for m in f.call_markers))


def default_call_id(index: int) -> str:
    """The id of a format without its own: ``call`` + 5 digits."""
    return ToolFormat.call_id.format(index=index)


def find_tool_format(template: str) -> ToolFormat | None:
    """The first row of :data:`TOOL_FORMATS` whose markers ``template`` holds, or None."""
    return next((f for f in TOOL_FORMATS if f.matches(template or "")), None)


def tool_format_for_template(template: str) -> ToolFormat:
    """:func:`find_tool_format`, or ValueError naming the supported families' markers."""
    found = find_tool_format(template)
    if found is None:
        known = "; ".join(" + ".join(alt) for f in TOOL_FORMATS for alt in f.markers)
        raise ValueError("no tool-call parser fits this chat template: it contains none of the tool-call markers "
                         f"of the supported families ({known}); add a row for its format to "
                         "agent_loop.episode.tool_formats.TOOL_FORMATS")
    return found


def parser_for_template(template: str, tools: list[dict] | None = None) -> Callable[[str], p.ParsedTurn]:
    """The parser of the template's tool format (see :meth:`ToolFormat.parser_for`); ValueError if none fits."""
    return tool_format_for_template(template).parser_for(tools)
