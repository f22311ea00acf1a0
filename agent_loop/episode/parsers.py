"""Tool-call parsers: the model's text of one assistant turn -> tool calls, parse errors and the text content.

One parser per tool-call format that vLLM serves (written here, matched to the formats the families'
chat templates render; see docs/templates.md for which template gets which):

- ``hermes``: Hermes/Qwen2.5/Qwen3 ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``qwen3_xml``: Qwen3-Coder/Qwen3.5 ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``;
  ``seed_oss``: the same inside ``<seed:tool_call>...</seed:tool_call>``
- ``glm45``: GLM-4.5+ ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``
- ``llama3_json``: Llama 3.x/4 ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` (``;``-separated)
- ``pythonic``: Llama 3.2/4, Gemma 3, ToolACE ``[f(a=1, b="x"), g()]``; ``lfm2``: the same list inside
  ``<|tool_call_start|>...<|tool_call_end|>``, after any text; ``minicpm3``: one call per line in a ```python fence
  inside those markers; ``olmo3``: one call per line inside ``<function_calls>...</function_calls>``
- ``mistral``: ``[TOOL_CALLS][{...}, ...]`` (JSON list) and ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` forms
- ``deepseek``: DeepSeek V3/R1 (``function<｜tool▁sep｜>NAME`` + a fenced JSON block) and V3.1 (``NAME<｜tool▁sep｜>{...}``)
- ``minimax_m2``: ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke>``;
  ``deepseek_v32``: the same with ``<｜DSML｜...>`` tags; ``muse_glimmer``: with ``<atem:...>`` tags, one call per message
- ``kimi_k2``: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``
- ``granite``: ``<|tool_call|>[{...}]``; ``granite_20b_fc``: ``<function_call> {...}``
- ``command_r``: ``Action: ```json [{"tool_name": ..., "parameters": {...}}] ````
- ``nemotron``: ``<TOOLCALL>[{...}]</TOOLCALL>``
- ``functools``: FireFunction / Phi-4-mini ``functools[{...}]``; ``functionary``: ``NAME\\n{...}>>>NAME\\n{...}``;
  ``functionary_v31``: ``<function=NAME>{...}</function>``
- ``internlm2``: ``<|action_start|><|plugin|>{...}<|action_end|>``; ``tool_calls_block``: Hunyuan/MiniMax
  ``<tool_calls>[...]</tool_calls>``; ``apertus``: ``<|tools_prefix|>[{"NAME": {...}}]<|tools_suffix|>``
- ``solar_open``: ``<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>``
- ``harmony``: gpt-oss ``to=functions.NAME<|channel|>commentary json<|message|>{...}``
- ``gemma``: Gemma 4 ``<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>`` and FunctionGemma ``<start_function_call>...``
- ``xlam``: a bare JSON list ``[{"name": ..., "arguments": {...}}]``
- ``hyperclovax``: ``-> tool/function_call\\n[{"name", "arguments"}, ...]`` (a message of its own);
  ``tools_tag``: vLLM's Qwen2.5-Coder ``<tools>{"name", "arguments"}</tools>``

Malformed calls become :class:`ParseError` items (error kind ``malformed_json``), never exceptions, so
the loop can answer them with an error observation. A parser that finds one of its own call markers in
a turn but reads no call from it reports a malformed call, never "no call" (:func:`reading_markers`):
a call the model meant must not vanish from the episode. The markers, like which parser a chat template gets,
are the tool-format table's business (:mod:`agent_loop.episode.tool_formats`): declared there once, they are
what the final-answer rule and this check both read.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ParsedCall:
    """One well-formed tool call."""

    name: str
    arguments: dict


@dataclass
class ParseError:
    """A call the model attempted that could not be parsed (error kind ``malformed_json``)."""

    raw: str  # the text of the attempted call
    error: str  # what was wrong, readable by the model


@dataclass
class ParsedTurn:
    """What an assistant turn said: its text without the calls, the calls in order, and the failed ones.

    ``reasoning``: for formats whose template renders the turn's reasoning from the message's own field
    (``reasoning_content``, as vLLM's reasoning parsers, verl and TRL name it) and not from its content, the
    reasoning exactly as written (Command R7B's plan); None for the others, whose reasoning stays in the content
    (Qwen3 ``<think>``: its template splits the content itself)."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    reasoning: str | None = None


Item = ParsedCall | ParseError


def _turn(content: str, items: list[Item]) -> ParsedTurn:
    return ParsedTurn(content.strip(), [c for c in items if isinstance(c, ParsedCall)],
                      [e for e in items if isinstance(e, ParseError)])


def _arguments(raw: str, name: str, arguments) -> Item:
    if isinstance(arguments, str):  # some models encode the arguments twice
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ParseError(raw, f"malformed JSON in tool call arguments: {e}")
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name:
        return ParseError(raw, "a tool call needs a string name")
    if not isinstance(arguments, dict):
        return ParseError(raw, f"tool call arguments must be a JSON object, got {type(arguments).__name__}")
    return ParsedCall(name, arguments)


def _call_from_obj(raw: str, obj, name_key: str = "name", arguments_key: str = "arguments") -> Item:
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return ParseError(raw, f'a tool call must be a JSON object with a string "{name_key}"')
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))  # tolerate either key
    return _arguments(raw, obj[name_key], arguments)


def _call_from_json(raw: str, arguments_key: str = "arguments", name_key: str = "name") -> Item:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParseError(raw, f"malformed JSON in tool call: {e}")
    return _call_from_obj(raw, obj, name_key, arguments_key)


def _calls_from_json_list(raw: str, name_key: str = "name", arguments_key: str = "arguments") -> list[Item]:
    """A JSON list of call objects (a single object is accepted too)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return [ParseError(raw, f"malformed JSON in tool calls: {e}")]
    objs = obj if isinstance(obj, list) else [obj]
    return [_call_from_obj(json.dumps(o), o, name_key, arguments_key) for o in objs]


def _json_sequence(body: str, arguments_key: str, separators: str = "; \n\t,") -> list[Item]:
    """Concatenated JSON call objects (``{...}{...}``, ``{...}; {...}``, one per line)."""
    decoder, items, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            items.append(_call_from_json(body[pos:].strip(), arguments_key))  # records the error
            break
        items.append(_call_from_json(body[pos:end], arguments_key))
        pos = end
        while pos < len(body) and body[pos] in separators:
            pos += 1
    return items


def _blocks(text: str, start: str, end: str) -> tuple[list[str], str]:
    """The bodies of ``start ... end`` blocks (an unclosed last block runs to the end) and the text outside them."""
    pattern = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|$)", re.DOTALL)
    return [m.group(1) for m in pattern.finditer(text)], pattern.sub("", text)


def _string_params(schemas: list[dict] | None, name: str) -> set[str]:
    """The parameters of tool ``name`` whose schema type is string (their text is kept as written)."""
    for schema in schemas or []:
        function = schema.get("function", schema)
        if function.get("name") == name:
            properties = function.get("parameters", {}).get("properties", {})
            return {k for k, v in properties.items() if v.get("type") == "string"}
    return set()


def _value(text: str):
    """A parameter value written as plain text: JSON where it parses (numbers, objects, ...), else the string."""
    if text in ("None", "True", "False"):  # Python spellings some templates write
        return {"None": None, "True": True, "False": False}[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def reading_markers(parse: Callable[..., ParsedTurn], markers: tuple[str, ...]) -> Callable[..., ParsedTurn]:
    """``parse`` made to report a turn holding one of ``markers`` (the format's own call markers, declared once in
    :data:`agent_loop.episode.tool_formats.TOOL_FORMATS`, which wraps every row's parser with this) from which it
    read neither a call nor an error: a :class:`ParseError`, so the malformed call is answered with an error
    observation instead of passing as a final answer."""
    if not markers:
        return parse

    @functools.wraps(parse)
    def checked(text: str, *args, **kwargs) -> ParsedTurn:
        turn = parse(text, *args, **kwargs)
        found = next((m for m in markers if m in text), None) if not (turn.calls or turn.errors) else None
        if found is not None:
            turn.errors.append(ParseError(text.strip(), f"malformed tool call: the turn contains {found!r} "
                                                        "but no call in this format could be read from it"))
        return turn
    checked.call_markers = markers
    return checked


# -- the parsers ---------------------------------------------------------------------------------


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen: each call is ``<tool_call>{json}</tool_call>``; an unclosed last call is parsed to the end. vLLM's
    Hermes 2 Pro template opens one ``<tool_call>`` for parallel calls and closes each, ``<tool_call>\n{..}\n</tool_call>
    {..}\n</tool_call>``: a JSON object closed by ``</tool_call>`` without an opener is a call too."""
    items: list[Item] = []
    content, pos = [], 0
    while pos < len(text):
        opened, closed = text.find("<tool_call>", pos), text.find("</tool_call>", pos)
        if opened >= 0 and (closed < 0 or opened < closed):
            content.append(text[pos:opened])
            start = opened + len("<tool_call>")
            end = text.find("</tool_call>", start)
            items.append(_call_from_json(text[start: end if end >= 0 else len(text)].strip()))
            pos = end + len("</tool_call>") if end >= 0 else len(text)
        elif closed >= 0 and text[pos:closed].strip().startswith("{"):  # closed but not opened
            items.append(_call_from_json(text[pos:closed].strip()))
            pos = closed + len("</tool_call>")
        else:
            content.append(text[pos: closed + len("</tool_call>") if closed >= 0 else len(text)])
            pos = closed + len("</tool_call>") if closed >= 0 else len(text)
    return _turn("".join(content), items)


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _xml_calls(bodies: list[str], schemas: list[dict] | None) -> list[Item]:
    """Calls in the Qwen3-Coder XML form, one per block body: ``<function=NAME><parameter=K>V</parameter></function>``."""
    items: list[Item] = []
    for body in bodies:
        m = _XML_FUNCTION.search(body)
        if m is None:
            items.append(ParseError(body, "a tool call must be <function=NAME>...</function>"))
            continue
        name = m.group(1).strip()
        strings = _string_params(schemas, name)
        items.append(ParsedCall(name, {k.strip(): v if k.strip() in strings else _value(v)
                                       for k, v in _XML_PARAMETER.findall(m.group(2))}))
    return items


def parse_qwen3_xml(text: str, schemas: list[dict] | None = None) -> ParsedTurn:
    """Qwen3-Coder/Qwen3.5: ``<tool_call><function=NAME><parameter=K>\\nV\\n</parameter></function></tool_call>``.

    Values of string-typed parameters (per the tool ``schemas``) are kept as written; other values are JSON
    where they parse (numbers, booleans, objects, lists), else strings, as vLLM's parser does.
    """
    bodies, content = _blocks(text, "<tool_call>", "</tool_call>")
    return _turn(content, _xml_calls(bodies, schemas))


def parse_seed_oss(text: str, schemas: list[dict] | None = None) -> ParsedTurn:
    """Seed-OSS: the Qwen3-Coder XML form inside the family's own tag,
    ``<seed:tool_call><function=NAME><parameter=K>V</parameter></function></seed:tool_call>`` (values typed as in
    :func:`parse_qwen3_xml`)."""
    bodies, content = _blocks(text, "<seed:tool_call>", "</seed:tool_call>")
    return _turn(content, _xml_calls(bodies, schemas))


def _invoke_parser(name: str, block: str, prefix: str = ""):
    """A parser for ``<{block}><{prefix}invoke name="NAME"><{prefix}parameter name="K">V</{prefix}parameter>...`` calls
    (values typed as in :func:`parse_qwen3_xml`; a ``string="true"`` attribute keeps a value as written)."""
    close = block.replace("<", "</", 1)
    invoke = re.compile(rf'<{prefix}invoke name="([^"]+)">(.*?)(?:</{prefix}invoke>|$)', re.DOTALL)
    param = re.compile(rf'<{prefix}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{prefix}parameter>', re.DOTALL)

    def parse(text: str, schemas: list[dict] | None = None) -> ParsedTurn:
        bodies, content = _blocks(text, block, close)
        items: list[Item] = []
        for body in bodies:
            calls = list(invoke.finditer(body))
            items += [ParsedCall(m.group(1), {k: v if as_string == "true" or k in _string_params(schemas, m.group(1))
                                              else _value(v) for k, as_string, v in param.findall(m.group(2))})
                      for m in calls] or [ParseError(body, f'a tool call must be <{prefix}invoke name="NAME">...')]
        return _turn(content, items)
    parse.__name__ = parse.__qualname__ = name
    return parse


parse_minimax_m2 = _invoke_parser("parse_minimax_m2", "<minimax:tool_call>")
parse_minimax_m2.__doc__ = "MiniMax-M2: ``<minimax:tool_call><invoke name=\"NAME\"><parameter name=\"K\">V</parameter></invoke>``."
parse_deepseek_v32 = _invoke_parser("parse_deepseek_v32", "<｜DSML｜function_calls>", "｜DSML｜")
parse_deepseek_v32.__doc__ = "DeepSeek V3.2: the same form with ``<｜DSML｜...>`` tags (DSML)."
_muse_glimmer_calls = _invoke_parser("parse_muse_glimmer", "<atem:function_calls>", "atem:")
_MUSE_HEADER = re.compile(r"(?:<\|eom\|>)?(?:<\|start\|>assistant)?\s*to=[^<\s]*\s*<\|message\|>")
_MUSE_REASONING = re.compile(r"^\s*to=self\s*<\|message\|>(.*?)<\|eom\|>", re.DOTALL)


def parse_muse_glimmer(text: str, schemas: list[dict] | None = None) -> ParsedTurn:
    """Muse Glimmer (ATEM): one call per message, ``to=NAME<|message|><atem:function_calls><atem:invoke name="NAME">
    <atem:parameter name="K">V</atem:parameter></atem:invoke></atem:function_calls>``, parallel calls as consecutive
    messages (``<|eom|><|start|>assistant to=NAME<|message|>...``) in one turn; values typed as in
    :func:`parse_qwen3_xml`. The message headers are not content; a first ``to=self`` message is the turn's
    reasoning (the template renders it from ``reasoning_content``)."""
    thought = _MUSE_REASONING.match(text)
    turn = _muse_glimmer_calls(text[thought.end():] if thought else text, schemas)
    turn.content = _MUSE_HEADER.sub("", turn.content).removesuffix("<|eom|>").strip()
    turn.reasoning = thought.group(1) if thought else None
    return turn


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm45(text: str, schemas: list[dict] | None = None) -> ParsedTurn:
    """GLM-4.5/4.6/4.7: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``
    (values typed as in :func:`parse_qwen3_xml`)."""
    bodies, content = _blocks(text, "<tool_call>", "</tool_call>")
    items: list[Item] = []
    for body in bodies:
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "\n" in name or "{" in name:
            items.append(ParseError(body, "a tool call must start with the function name"))
            continue
        strings = _string_params(schemas, name)
        items.append(ParsedCall(name, {k.strip(): v if k.strip() in strings else _value(v) for k, v in _GLM_ARG.findall(body)}))
    return _turn(content, items)


_PYTHON_TAG = "<|python_tag|>"
_PYTHON_BLOCK = re.compile(r"^<\|python_start\|>(.*?)(?:<\|python_end\|>|$)", re.DOTALL)


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.x/4 JSON: the turn is ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` (``;``-separated); vLLM's
    Llama 4 JSON template (an earlier revision) writes a call turn as ``<|python_start|>CONTENT<|python_end|>{...}{...}``.

    A turn that does not start with ``{`` (after the optional tag or python block) is plain content.
    """
    body, content = text.strip(), ""
    if (block := _PYTHON_BLOCK.match(body)) is not None:  # the row's call markers flag a block with no call after it
        content, body = block.group(1), body[block.end():].strip()
        if not body.startswith("{"):
            return ParsedTurn((content + body).strip())
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip() if not tagged else body)
    return _turn(content, _json_sequence(body, "parameters"))


_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON literals some templates write inside Python calls


class _JsonLiterals(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Constant(_JSON_NAMES[node.id]) if node.id in _JSON_NAMES else node


def _python_call(node: ast.expr, raw: str) -> Item:
    if not isinstance(node, ast.Call) or node.args:
        return ParseError(raw, "each pythonic tool call must be NAME(keyword=value, ...)")
    name = ast.unparse(node.func)
    try:
        return ParsedCall(name, {kw.arg: ast.literal_eval(_JsonLiterals().visit(kw.value)) for kw in node.keywords})
    except (ValueError, SyntaxError, TypeError) as e:
        return ParseError(raw, f"tool call arguments must be Python literals: {e}")


def _python_calls(body: str) -> list[Item]:
    """The calls of a pythonic call list ``[f(a=1, b="x"), g()]`` (JSON ``true``/``false``/``null`` read as literals)."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except SyntaxError as e:
        return [ParseError(body, f"malformed pythonic tool calls: {e.msg}")]
    if not isinstance(tree, ast.List):
        return [ParseError(body, "pythonic tool calls must be a list [f(...), ...]")]
    return [_python_call(node, body) for node in tree.elts]


_BARE_CALL = re.compile(r"^[A-Za-z_][\w.]*\([^()\s]*\s*=")  # NAME(keyword= (or a mangled one) opening the turn


def parse_pythonic(text: str) -> ParsedTurn:
    """Pythonic calls (Llama 3.2/4, Gemma 3, ToolACE): ``[f(a=1, b="x"), g()]``, optionally inside
    ``<|python_start|>...<|python_end|>``; also without the brackets, ``f(a=1), g(b=2)``, as an earlier revision of
    vLLM's Llama 4 pythonic template renders them. Any other turn that does not start with ``[`` is plain content."""
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not body.startswith("["):
        if _BARE_CALL.match(body):
            return _turn("", _python_calls(f"[{body}]"))
        return ParsedTurn(text.strip())
    return _turn("", _python_calls(body))


def _python_statements(body: str) -> list[Item]:
    """Pythonic calls one per line (``f(a='x')\\ng(b=1)``, OLMo 3, MiniCPM3), or a call list ``[f(), g()]``; JSON
    ``true``/``false``/``null`` read as literals. A body with no call is a malformed call, never no call."""
    try:
        statements = ast.parse(body.strip()).body
    except SyntaxError as e:
        return [ParseError(body, f"malformed pythonic tool calls: {e.msg}")]
    if len(statements) == 1 and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.List):
        statements = [ast.Expr(node) for node in statements[0].value.elts]
    if not statements:
        return [ParseError(body, "a tool-call block must hold calls NAME(keyword=value, ...), one per line")]
    return [_python_call(s.value, body) if isinstance(s, ast.Expr) else
            ParseError(body, "each pythonic tool call must be NAME(keyword=value, ...)") for s in statements]


def parse_olmo3(text: str) -> ParsedTurn:
    """OLMo 3: ``<function_calls>\\nf(a='x', n=1)\\ng(b=null)\\n</function_calls>``, one pythonic call per line, after
    any text."""
    bodies, content = _blocks(text, "<function_calls>", "</function_calls>")
    return _turn(content, [item for body in bodies for item in _python_statements(body)])


_PYTHON_FENCE = re.compile(r"^\s*```(?:python)?\s*\n?(.*?)\s*```\s*$", re.DOTALL)


def parse_minicpm3(text: str) -> ParsedTurn:
    """MiniCPM3: ``<|tool_call_start|>\\n```python\\nf(a="x",n=1)\\n```\\n<|tool_call_end|>``, one call per line with
    JSON values; the text around the block is the content."""
    bodies, content = _blocks(text, "<|tool_call_start|>", "<|tool_call_end|>")
    items: list[Item] = []
    for body in bodies:
        fenced = _PYTHON_FENCE.match(body)
        items += _python_statements(fenced.group(1) if fenced else body)
    return _turn(content, items)


def parse_lfm2(text: str) -> ParsedTurn:
    """LFM2/LFM2.5: a pythonic call list between ``<|tool_call_start|>`` and ``<|tool_call_end|>``, after any text
    (``Let me check.<|tool_call_start|>[f(a=1)]<|tool_call_end|>``); string values quoted, objects as JSON."""
    bodies, content = _blocks(text, "<|tool_call_start|>", "<|tool_call_end|>")
    return _turn(content, [item for body in bodies for item in _python_calls(body)])


_MISTRAL_NAMED = re.compile(r"^\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\](.*)$", re.DOTALL)


def parse_mistral(text: str) -> ParsedTurn:
    """Mistral: ``[TOOL_CALLS][{"name", "arguments"}, ...]`` (v3/v7/Nemo) or, per call,
    ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` / ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11+, Small 3.2, Devstral)."""
    content, *parts = text.split("[TOOL_CALLS]")
    items: list[Item] = []
    for part in parts:
        part = part.strip()
        named = _MISTRAL_NAMED.match(part)
        if named:
            items.append(_arguments(part, named.group(1), named.group(3).strip()))
        elif part.startswith(("[", "{")):
            items += _calls_from_json_list(part)
        else:
            items.append(ParseError(part, "a Mistral tool call must be NAME[ARGS]{...} or a JSON list of calls"))
    return _turn(content, items)


_DS_BEGIN, _DS_SEP, _DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_SECTION = re.compile(r"<｜tool▁calls▁begin｜>.*?(?:<｜tool▁calls▁end｜>|$)", re.DOTALL)
_FENCED = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_deepseek(text: str) -> ParsedTurn:
    """DeepSeek V3/R1 (``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```````) and V3.1
    (``NAME<｜tool▁sep｜>{...}``), each inside ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``."""
    bodies, _ = _blocks(text, _DS_BEGIN, _DS_END)
    items: list[Item] = []
    for body in bodies:
        left, sep, right = body.partition(_DS_SEP)
        if not sep:
            items.append(ParseError(body, f"a DeepSeek tool call must contain {_DS_SEP}"))
            continue
        if left.strip() == "function":  # V3/R1: the name on the first line, the arguments in a fenced block
            name, _, args = right.partition("\n")
            fenced = _FENCED.match(args)
            items.append(_arguments(body, name.strip(), fenced.group(1) if fenced else args.strip()))
        else:
            items.append(_arguments(body, left.strip(), right.strip()))
    return _turn(_DS_SECTION.sub("", text), items)


_KIMI_SECTION = re.compile(r"<\|tool_calls_section_begin\|>.*?(?:<\|tool_calls_section_end\|>|$)", re.DOTALL)
_KIMI_ID = re.compile(r"^\s*(?:functions\.)?([^:\s]+)(?::\d+)?\s*$")


def parse_kimi_k2(text: str) -> ParsedTurn:
    """Kimi K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``."""
    bodies, _ = _blocks(text, "<|tool_call_begin|>", "<|tool_call_end|>")
    items: list[Item] = []
    for body in bodies:
        call_id, sep, args = body.partition("<|tool_call_argument_begin|>")
        m = _KIMI_ID.match(call_id)
        items.append(_arguments(body, m.group(1), args.strip()) if sep and m else
                     ParseError(body, "a Kimi tool call must be functions.NAME:IDX<|tool_call_argument_begin|>{...}"))
    return _turn(_KIMI_SECTION.sub("", text), items)


def _marker_then_list(name: str, marker: str, end: str | None = None, name_key: str = "name",
                      arguments_key: str = "arguments"):
    """A parser for formats that write one JSON list of calls after ``marker`` (up to ``end``)."""
    def parse(text: str) -> ParsedTurn:
        content, sep, rest = text.partition(marker)
        if not sep:
            return ParsedTurn(text.strip())
        body, _, after = rest.partition(end) if end else (rest, "", "")
        fenced = _FENCED.match(body)
        return _turn(content + after, _calls_from_json_list((fenced.group(1) if fenced else body).strip(), name_key, arguments_key))
    parse.__name__ = parse.__qualname__ = name
    return parse


parse_granite = _marker_then_list("parse_granite", "<|tool_call|>")
parse_granite.__doc__ = "Granite 3.x: ``<|tool_call|>[{\"name\", \"arguments\"}, ...]``."
parse_nemotron = _marker_then_list("parse_nemotron", "<TOOLCALL>", "</TOOLCALL>")
parse_nemotron.__doc__ = "Nemotron: ``<TOOLCALL>[{\"name\", \"arguments\"}, ...]</TOOLCALL>``."
_functools_list = _marker_then_list("parse_functools", "functools")


def parse_functools(text: str) -> ParsedTurn:
    """FireFunction v2 / Phi-4-mini: ``functools[{"name", "arguments"}, ...]``; also the bare
    ``{...},{...}`` that the Phi-4-mini template renders for past calls."""
    if "functools" not in text and text.strip().startswith("{"):
        return _turn("", _json_sequence(text.strip(), "arguments"))
    return _functools_list(text)


_command_r_action = _marker_then_list("parse_command_r", "Action:", None, "tool_name", "parameters")
_command_r7b_action = _marker_then_list("parse_command_r", "<|START_ACTION|>", "<|END_ACTION|>", "tool_name", "parameters")


_R7B_RESPONSE = re.compile(r"<\|START_RESPONSE\|>(.*?)(?:<\|END_RESPONSE\|>|$)", re.DOTALL)
_R7B_THINKING = re.compile(r"<\|START_THINKING\|>(.*?)<\|END_THINKING\|>", re.DOTALL)


def parse_command_r(text: str) -> ParsedTurn:
    """Command R7B/A: ``<|START_THINKING|>PLAN<|END_THINKING|><|START_ACTION|>[{"tool_call_id", "tool_name",
    "parameters"}, ...]<|END_ACTION|>``, and a reply ``<|START_RESPONSE|>TEXT<|END_RESPONSE|>`` whose content is TEXT.
    The template writes those markers itself: a tool-call turn as ``<|START_THINKING|>{{ reasoning_content }}
    <|END_THINKING|>`` + the calls (its content is not rendered), an answer as ``<|START_RESPONSE|>{{ content }}
    <|END_RESPONSE|>``; so PLAN is the turn's reasoning, kept exactly as written, and no marker stays in the
    content (it would render twice in the one-go render of the episode). Command R/R+: ``Action: ```json
    [{"tool_name", "parameters"}] ````."""
    plan = _R7B_THINKING.search(text)
    rest = text if plan is None else text[: plan.start()] + text[plan.end():]
    reasoning = None if plan is None else plan.group(1)
    if "<|START_ACTION|>" in rest:
        turn = _command_r7b_action(rest)
    elif (response := _R7B_RESPONSE.search(rest)) is not None:
        turn = ParsedTurn(response.group(1).strip())
    else:
        return _command_r_action(text)
    turn.reasoning = reasoning
    return turn


def parse_granite_20b_fc(text: str) -> ParsedTurn:
    """Granite 20B function calling: each call is ``<function_call> {json}``."""
    content, *parts = text.split("<function_call>")
    return _turn(content, [_call_from_json(p.strip()) for p in parts])


def parse_internlm2(text: str) -> ParsedTurn:
    """InternLM2: ``<|action_start|><|plugin|>\\n{json}<|action_end|>``."""
    bodies, content = _blocks(text, "<|action_start|>", "<|action_end|>")
    return _turn(content, [_call_from_json(b.removeprefix("<|plugin|>").strip()) for b in bodies])


def parse_tool_calls_block(text: str) -> ParsedTurn:
    """Hunyuan-A13B / MiniMax-M1: ``<tool_calls>`` + a JSON list or one JSON object per line + ``</tool_calls>``."""
    bodies, content = _blocks(text, "<tool_calls>", "</tool_calls>")
    items: list[Item] = []
    for body in map(str.strip, bodies):
        items += _calls_from_json_list(body) if body.startswith("[") else _json_sequence(body, "arguments")
    return _turn(content, items)


_HCX_CALLS = "-> tool/function_call"
_HCX_OPEN = re.compile(r"(?:<\|im_end\|>)?\s*(?:<\|im_start\|>assistant)?\s*$")


def parse_hyperclovax(text: str) -> ParsedTurn:
    """HyperCLOVA X SEED Think: the calls are a message of their own, ``<|im_start|>assistant -> tool/function_call\\n
    [{"name", "arguments"}, ...]<|im_end|><|stop|>``; after the generation prompt ``<|im_start|>assistant`` the turn
    is `` -> tool/function_call\\n[...]``. The text before it (a content message of its own) is the content."""
    content, sep, rest = text.partition(_HCX_CALLS)
    if not sep:
        return ParsedTurn(text.strip())
    body = rest.split("<|im_end|>", 1)[0].strip()
    return _turn(_HCX_OPEN.sub("", content), _calls_from_json_list(body))


def parse_tools_tag(text: str) -> ParsedTurn:
    """vLLM's Qwen2.5-Coder template: each call is ``<tools>\\n{"name", "arguments"}\\n</tools>``, after any text."""
    bodies, content = _blocks(text, "<tools>", "</tools>")
    return _turn(content, [_call_from_json(b.strip()) for b in bodies])


def parse_apertus(text: str) -> ParsedTurn:
    """Apertus: ``<|tools_prefix|>[{"NAME": {arguments}}, ...]<|tools_suffix|>``."""
    bodies, content = _blocks(text, "<|tools_prefix|>", "<|tools_suffix|>")
    items: list[Item] = []
    for body in bodies:
        try:
            objs = json.loads(body)
        except json.JSONDecodeError as e:
            items.append(ParseError(body, f"malformed JSON in tool calls: {e}"))
            continue
        for obj in objs if isinstance(objs, list) else [objs]:
            if isinstance(obj, dict) and len(obj) == 1:
                (name, args), = obj.items()
                items.append(_arguments(json.dumps(obj), name, args))
            else:
                items.append(ParseError(json.dumps(obj), 'each Apertus tool call must be {"NAME": {arguments}}'))
    return _turn(content, items)


_SOLAR_CALL = re.compile(r"^([^<]*)<\|tool_call:name\|>([^<]+)<\|tool_call:args\|>(.*)$", re.DOTALL)


def parse_solar_open(text: str) -> ParsedTurn:
    """Solar Open: ``<|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>``
    per call (the turn then ends with ``<|calls|>``); the text before ``<|tool_calls|>`` is the content."""
    content, _, calls = text.partition("<|tool_calls|>")
    bodies, rest = _blocks(calls, "<|tool_call:begin|>", "<|tool_call:end|>")
    items: list[Item] = []
    for body in bodies:
        m = _SOLAR_CALL.match(body)
        items.append(_arguments(body, m.group(2).strip(), m.group(3).strip()) if m else
                     ParseError(body, "a tool call must be ID<|tool_call:name|>NAME<|tool_call:args|>{...}"))
    return _turn(content + rest.removesuffix("<|calls|>"), items)


_HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|channel\|>[^<]*)?<\|message\|>(.*?)(?=<\|call\|>|<\|end\|>|<\|start\|>|$)",
                           re.DOTALL)
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?=<\|end\|>|<\|return\|>|<\|start\|>|$)", re.DOTALL)


def parse_harmony(text: str) -> ParsedTurn:
    """gpt-oss (harmony): ``to=functions.NAME<|channel|>commentary json<|message|>{...}``; content is the final channel."""
    items = [_arguments(m.group(0), m.group(1), m.group(2).strip()) for m in _HARMONY_CALL.finditer(text)]
    final = _HARMONY_FINAL.findall(text)
    return _turn("".join(final) if final or items else text, items)


_FUNCTIONARY_V31 = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)


def parse_functionary_v31(text: str) -> ParsedTurn:
    """Functionary v3.1 (Llama 3.1): each call is ``<function=NAME>{json}</function>``."""
    items = [_arguments(m.group(0), m.group(1).strip(), m.group(2).strip()) for m in _FUNCTIONARY_V31.finditer(text)]
    return _turn(_FUNCTIONARY_V31.sub("", text), items)


def parse_functionary(text: str) -> ParsedTurn:
    """Functionary v3.2: ``NAME\\n{json}>>>NAME\\n{json}`` after the ``>>>`` of the prompt; ``all`` is text."""
    content, items = [], []
    for part in text.split(">>>"):
        name, _, body = part.partition("\n")
        if name.strip() in ("all", ""):
            content.append(body if name.strip() else part)
        else:
            items.append(_arguments(part, name.strip(), body.strip() or "{}"))
    return _turn("".join(content), items)


_GEMMA_STRINGS = ('<|"|>', "<escape>")
_GEMMA_CLOSE = {"<|tool_call>": "<tool_call|>", "<start_function_call>": "<end_function_call>"}
_GEMMA_MARK = re.compile("|".join(map(re.escape, [*_GEMMA_CLOSE, *_GEMMA_CLOSE.values()])))  # opener or close
_GEMMA_CALL_WORD = re.compile(r"call\s*:")
_GEMMA_HEAD = re.compile(r"\s*call\s*:\s*([A-Za-z0-9_.\-]+)\s*")
_GEMMA_BARE = re.compile(r"[^,}\]]*")


def _skip_space(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _gemma_value(s: str, i: int):
    """Parse Gemma's argument syntax from ``s[i:]``: ``<|"|>str<|"|>``, ``{k:v,...}``, ``[v,...]``, bare
    literals; returns ``(value, end)``. ValueError (never a hang) for anything cut short or out of place."""
    i = _skip_space(s, i)
    if i >= len(s):
        raise ValueError("the arguments end before a value")
    for q in _GEMMA_STRINGS:
        if s.startswith(q, i):
            end = s.find(q, i + len(q))
            if end < 0:
                raise ValueError(f"a string opened with {q} at character {i} is never closed")
            return s[i + len(q): end], end + len(q)
    if s[i] in "{[":
        close, out = ("}", {}) if s[i] == "{" else ("]", [])
        i = _skip_space(s, i + 1)
        while not s.startswith(close, i):
            if i >= len(s):
                raise ValueError(f"a {'{' if close == '}' else '['} is never closed by {close}")
            if close == "}":
                key, i = _gemma_key(s, i)
                out[key], i = _gemma_value(s, i)
            else:
                value, i = _gemma_value(s, i)
                out.append(value)
            i = _skip_space(s, i)
            if s.startswith(",", i):
                i = _skip_space(s, i + 1)
            elif not s.startswith(close, i):
                raise ValueError(f"expected ',' or {close!r} at character {i}, found {s[i:i + 20]!r}")
        return out, i + 1
    m = _GEMMA_BARE.match(s, i)
    if not m.group(0).strip():
        raise ValueError(f"no value at character {i}")
    return _value(m.group(0).strip()), m.end()


def _gemma_key(s: str, i: int) -> tuple[str, int]:
    """A key (bare or ``<|"|>``-quoted) and the position after its ``:``."""
    if any(s.startswith(q, i) for q in _GEMMA_STRINGS):
        key, i = _gemma_value(s, i)
    else:
        colon = s.find(":", i)
        if colon < 0:
            raise ValueError(f"a key at character {i} has no ':'")
        key, i = s[i:colon].strip(), colon
    i = _skip_space(s, i)
    if not s.startswith(":", i) or not key:
        raise ValueError(f"expected KEY: at character {i}")
    return key, i + 1


def _gemma_call(text: str, opened: int, marker: str) -> tuple[Item, int]:
    """The call opened by ``marker`` at ``opened`` (a ParsedCall or a ParseError, never nothing) and where it ends."""
    close = _GEMMA_CLOSE[marker]
    closed = text.find(close, opened)
    fallback_end = closed + len(close) if closed >= 0 else len(text)
    head = _GEMMA_HEAD.match(text, opened + len(marker))
    if head is None or not text.startswith("{", head.end()):
        raw = text[opened:fallback_end]
        return ParseError(raw, f"a Gemma tool call must be {marker}call:NAME{{key:value,...}}{close}"), fallback_end
    try:
        arguments, i = _gemma_value(text, head.end())
    except ValueError as e:
        return ParseError(text[opened:fallback_end], f"malformed Gemma tool call arguments: {e}"), fallback_end
    i = _skip_space(text, i)
    if text.startswith(close, i) or i == len(text):  # closed, or cut at the end of the turn
        end = min(len(text), i + len(close)) if text.startswith(close, i) else i
        return _arguments(text[opened:end], head.group(1), arguments), end
    return ParseError(text[opened:fallback_end], f"text after a Gemma tool call's arguments, before {close}"), fallback_end


def parse_gemma(text: str) -> ParsedTurn:
    """Gemma 4 ``<|tool_call>call:NAME{k:<|"|>v<|"|>,n:2}<tool_call|>`` and FunctionGemma
    ``<start_function_call>call:NAME{k:<escape>v<escape>}<end_function_call>``: every opened call is a call
    or a ParseError, and so is every close marker no opener matched (``call:NAME{...}<tool_call|>``: a ParseError
    naming the missing opener, its text from ``call:`` on; the turn stays as sampled, which a parsed call would
    not: the template writes the opener)."""
    items: list[Item] = []
    content, pos = [], 0
    while (m := _GEMMA_MARK.search(text, pos)) is not None:
        if m.group(0) in _GEMMA_CLOSE:
            content.append(text[pos:m.start()])
            item, pos = _gemma_call(text, m.start(), m.group(0))
        else:
            item, start = _gemma_unopened(text, pos, m)
            content.append(text[pos:start])
            pos = m.end()
        items.append(item)
    content.append(text[pos:])
    return _turn("".join(content), items)


def _gemma_unopened(text: str, pos: int, close: re.Match) -> tuple[ParseError, int]:
    """The ParseError of a call closed by ``close`` with no opener after ``pos``, and where its text starts (the
    last ``call:`` before the close marker, else ``pos``)."""
    opener = next(o for o, c in _GEMMA_CLOSE.items() if c == close.group(0))
    heads = [h.start() for h in _GEMMA_CALL_WORD.finditer(text, pos, close.start())]
    start = heads[-1] if heads else pos
    return ParseError(text[start:close.end()], f"a Gemma tool call without its opener {opener}: it closes with "
                                               f"{close.group(0)} but does not open; write "
                                               f"{opener}call:NAME{{key:value,...}}{close.group(0)}"), start


def parse_xlam(text: str) -> ParsedTurn:
    """xLAM: the turn is a JSON list ``[{"name", "arguments"}, ...]`` (optionally fenced); anything else is content."""
    body = text.strip()
    fenced = _FENCED.match(body)
    body = fenced.group(1) if fenced else body
    if not body.startswith("["):
        return ParsedTurn(text.strip())
    return _turn("", _calls_from_json_list(body))
