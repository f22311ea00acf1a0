"""Tool-call formats of vLLM's ``examples/`` templates (issue 56 item 6), each on its real template from
``tests/data/chat_templates`` (see SOURCES.md): OLMo 3 ``<function_calls>`` (one pythonic call per line), MiniCPM3
(a ```python block inside ``<|tool_call_start|>``: it was read by the LFM2 parser, which expects a list, so every
call it rendered came back as a malformed call), Muse Glimmer's ATEM blocks (one call per message), HyperCLOVA X
SEED Think (calls as a message of their own), and vLLM's Qwen2.5-Coder ``<tools>`` blocks; and the calls of vLLM
templates that were read as no call: Llama 4 JSON's python block before the calls, pythonic calls without brackets,
and Hermes 2 Pro's parallel calls under one ``<tool_call>``."""

import pytest
from test_chat_templates import CALCULATOR, tokenizer  # noqa: F401 (fixture)

from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.tool_formats import find_tool_format, parser_for_template
from tests.helpers.testdata import read_template

FORMATS = {
    "vllm_tool_chat_template_olmo3.jinja": "olmo3",
    "vllm_tool_chat_template_minicpm3.jinja": "minicpm3",
    "vllm_tool_chat_template_muse_glimmer.jinja": "muse_glimmer",
    "vllm_tool_chat_template_hyperclovax_seed_think_14b.jinja": "hyperclovax",
    "vllm_tool_chat_template_qwen2_5_coder.jinja": "tools_tag",
    # formats the table had: the vLLM variants of present families
    "vllm_tool_chat_template_nemotron_json.jinja": "nemotron",
    "vllm_tool_chat_template_deepseekv32.jinja": "deepseek",  # V3.1-style calls, not DSML
    "vllm_tool_chat_template_llama3.1_usr_def_tool_call.jinja": "functionary_v31",
    "vllm_command_r_tool_chat_template.jinja": "command_r",
    "lfm2.5-8b-a1b.jinja": "lfm2",  # still LFM2: the MiniCPM3 row needs its ```python block too
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_template_gets_its_format(name):
    assert find_tool_format(read_template(name)).name == FORMATS[name]


CALLS = [("calculator", {"expression": "2+3", "options": {"exact": True}}), ("lookup", {"key": "x", "missing": None})]
TURNS = [  # (template, a turn as the model writes it after the generation prompt, its content)
    ("vllm_tool_chat_template_olmo3.jinja", "Let me check.\n<function_calls>\ncalculator(expression='2+3', "
     "options={\"exact\": true})\nlookup(key='x', missing=null)\n</function_calls>", "Let me check."),
    ("vllm_tool_chat_template_minicpm3.jinja", '<|tool_call_start|>\n```python\ncalculator(expression="2+3",options='
     '{"exact": true})\nlookup(key="x",missing=null)\n```\n<|tool_call_end|>\nLet me check.', "Let me check."),
    ("vllm_tool_chat_template_muse_glimmer.jinja", ' to=calculator<|message|><atem:function_calls>\n<atem:invoke '
     'name="calculator">\n<atem:parameter name="expression">2+3</atem:parameter>\n<atem:parameter name="options">'
     '{"exact": true}</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eom|><|start|>assistant to=lookup'
     '<|message|><atem:function_calls>\n<atem:invoke name="lookup">\n<atem:parameter name="key">x</atem:parameter>\n'
     '<atem:parameter name="missing">null</atem:parameter>\n</atem:invoke>\n</atem:function_calls>', ""),
    ("vllm_tool_chat_template_hyperclovax_seed_think_14b.jinja", '\nLet me check.<|im_end|>\n<|im_start|>assistant -> '
     'tool/function_call\n[{"name": "calculator", "arguments": {"expression": "2+3", "options": {"exact": true}}}, '
     '{"name": "lookup", "arguments": {"key": "x", "missing": null}}]<|im_end|>', "Let me check."),
    ("vllm_tool_chat_template_qwen2_5_coder.jinja", 'Let me check.<tools>\n{"name": "calculator", "arguments": '
     '{"expression": "2+3", "options": {"exact": true}}}\n</tools>\n<tools>\n{"name": "lookup", "arguments": '
     '{"key": "x", "missing": null}}\n</tools>\n', "Let me check."),
]


@pytest.mark.parametrize("name, text, content", TURNS)
def test_calls_are_read(name, text, content):
    turn = parser_for_template(read_template(name), [CALCULATOR])(text)
    assert [(c.name, c.arguments) for c in turn.calls] == CALLS
    assert turn.content == content and not turn.errors


BROKEN = [  # a call the model meant, that cannot be read: a malformed call, never no call
    ("vllm_tool_chat_template_olmo3.jinja", "<function_calls>\ncalculator(expression='2+3'\n</function_calls>"),
    ("vllm_tool_chat_template_olmo3.jinja", "<function_calls>\n</function_calls>"),
    ("vllm_tool_chat_template_olmo3.jinja", "<function_calls>\nx = 1\n</function_calls>"),
    ("vllm_tool_chat_template_minicpm3.jinja", '<|tool_call_start|>\n```python\ncalculator(expression="2+3"\n```\n'
     '<|tool_call_end|>'),
    ("vllm_tool_chat_template_muse_glimmer.jinja", "<atem:function_calls><atem:invoke calculator></atem:function_calls>"),
    ("vllm_tool_chat_template_hyperclovax_seed_think_14b.jinja", ' -> tool/function_call\n[{"name": calculator}]'),
    ("vllm_tool_chat_template_qwen2_5_coder.jinja", '<tools>\n{"name": calculator}\n</tools>'),
]


@pytest.mark.parametrize("name, text", BROKEN)
def test_a_broken_call_is_a_malformed_call(name, text):
    parse = parser_for_template(read_template(name))
    turn = parse(text)
    assert not turn.calls and len(turn.errors) == 1 and turn.errors[0].error
    plain = parse("The answer is 5.")
    assert plain.content == "The answer is 5." and not plain.calls and not plain.errors


def test_minicpm3_calls_were_malformed_under_the_lfm2_parser():
    """The gap: the MiniCPM3 template holds LFM2's ``<|tool_call_start|>``, and the LFM2 parser expects a list
    ``[f(...)]`` there; the template's own call block came back as a malformed call."""
    lfm2 = parser_for_template(read_template("lfm2.5-8b-a1b.jinja"))
    text = TURNS[1][1]
    assert not lfm2(text).calls and lfm2(text).errors
    assert parser_for_template(read_template("vllm_tool_chat_template_minicpm3.jinja"))(text).calls


def test_muse_glimmer_reasoning_message_is_the_turns_reasoning():
    """The template renders ``to=self<|message|>REASONING<|eom|>`` from ``reasoning_content`` and a call message's
    content not at all: the reasoning goes to :attr:`ParsedTurn.reasoning`, so the turn renders as sampled."""
    parse = parser_for_template(read_template("vllm_tool_chat_template_muse_glimmer.jinja"))
    turn = parse(' to=self<|message|>I should compute.<|eom|><|start|>assistant to=calculator<|message|>'
                 '<atem:function_calls>\n<atem:invoke name="calculator">\n<atem:parameter name="expression">12'
                 '</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
    assert turn.reasoning == "I should compute." and turn.content == ""
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": 12})]
    answer = parse(" to=user<|message|>It is 5.")
    assert answer.content == "It is 5." and answer.reasoning is None and not answer.calls


def test_hyperclovax_call_turn_stops_on_its_stop_token(tokenizer):  # noqa: F811
    """A call turn ends ``<|im_end|><|stop|>`` (an answer ``<|im_end|><|endofturn|>``): ``<|stop|>`` is a stop token,
    so generation ends there where ``<|im_end|>`` is not the model's eos."""
    formatter = ChatFormatter(tokenizer, tools=[CALCULATOR], bos_token="",
                              chat_template=read_template("vllm_tool_chat_template_hyperclovax_seed_think_14b.jinja"))
    stops = [tokenizer.decode([t]) for t in formatter.end_of_turn_ids]
    assert "<|endofturn|>" in stops and "<|stop|>" in stops


@pytest.mark.parametrize("name", ["vllm_tool_chat_template_nemotron_json.jinja",
                                  "vllm_tool_chat_template_nemotron_nano_v2.jinja"])
def test_nemotron_json_renders_the_calls_only_once_results_follow(tokenizer, name):  # noqa: F811
    """vLLM's Nemotron JSON templates render a last assistant message as a continuation (its content only): the
    round trip reads the calls from a render with their results after them (tests/episode/test_parser_roundtrip.py)."""
    formatter = ChatFormatter(tokenizer, tools=[CALCULATOR], chat_template=read_template(name), history_mode="keep_seen")
    call = {"id": "call00000", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    head = [{"role": "user", "content": "Compute."}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    alone = formatter.render_text(head)
    assert "<TOOLCALL>" not in alone[alone.index("Compute."):]
    followed = formatter.render_text(head + [{"role": "tool", "tool_call_id": "call00000", "content": "5"}])
    turn = followed[followed.index("Compute."):]
    text = turn[turn.index("<TOOLCALL>"): turn.index("</TOOLCALL>") + len("</TOOLCALL>")]
    parsed = parser_for_template(read_template(name))(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2+3"})]


def test_llama4_json_python_block_before_the_calls_is_not_a_silent_miss():
    """vLLM's Llama 4 JSON template at c0d4a465b32f writes a call turn as ``<|python_start|>CONTENT<|python_end|>``
    + the JSON calls: the Llama 3 JSON parser took the whole turn for content (rendered calls read as no call and no
    error). Now the calls are read after the block, and a block with no call after it is a malformed call."""
    parse = parser_for_template(read_template("vllm_tool_chat_template_llama4_json.c0d4a465b32f.jinja"))
    turn = parse('<|python_start|>Let me check.<|python_end|>{"name": "calculator", "parameters": {"expression": '
                 '"2+3"}}{"name": "lookup", "parameters": {"key": "x"}}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2+3"}), ("lookup", {"key": "x"})]
    assert turn.content == "Let me check." and not turn.errors
    empty = parse("<|python_start|>Let me check.<|python_end|>")
    assert not empty.calls and len(empty.errors) == 1 and "<|python_start|>" in empty.errors[0].error
    assert parse("The answer is 5.").content == "The answer is 5."


def test_pythonic_calls_without_brackets_are_read_or_reported():
    """vLLM's Llama 4 pythonic template at 5a6541db9bfa writes the calls without the list brackets,
    ``f(a=1), g(b=2)``, and ends the turn with ``<|eom|>``: the pythonic parser read them as content (a silent miss).
    Valid ones are calls now, invalid ones (the template writes values unquoted) malformed calls; a turn that only
    mentions a call stays content."""
    template = read_template("vllm_tool_chat_template_llama4_pythonic.5a6541db9bfa.jinja")
    assert find_tool_format(template).stop_tokens == ("<|eom|>",)
    parse = parser_for_template(template)
    turn = parse("calculator(expression='2+3'), lookup(key='x')")
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2+3"}), ("lookup", {"key": "x"})]
    rendered = parse('calculator(expression=2+3), lookup(key=say "hi")')
    assert not rendered.calls and rendered.errors
    for answer in ("f(x) = 2x, so the answer is 4.", "The answer is max(a=1).", "print(1)"):
        plain = parse(answer)
        assert plain.content == answer and not plain.calls and not plain.errors


def test_hermes_2_pro_parallel_calls_under_one_opener_are_all_read():
    """vLLM's Hermes 2 Pro template opens one ``<tool_call>`` for parallel calls and closes each: the Hermes parser
    read the first call and left the second in the content (one of two calls dropped, no error). A JSON object
    closed by ``</tool_call>`` without an opener is a call now; a broken one is a malformed call."""
    parse = parser_for_template(read_template("vllm_tool_chat_template_hermes_2_pro.jinja"))
    turn = parse('<tool_call>\n{ "arguments": {"expression": "2+3"}, "name": "calculator"}\n</tool_call> '
                 '{ "arguments": {"key": "x"}, "name": "lookup"}\n</tool_call> ')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2+3"}), ("lookup", {"key": "x"})]
    assert turn.content == "" and not turn.errors
    broken = parse('<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call> {"name": lookup}\n</tool_call>')
    assert [c.name for c in broken.calls] == ["calculator"] and len(broken.errors) == 1
    assert parse("It is 5.").content == "It is 5."
