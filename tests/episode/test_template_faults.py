"""Issue 30, templates and parsers: a template's own counter of tool results across the chat (reproduced when it
only appends, refused up front with the true reason when it rewrites text already seen), and a parser that
sees its own call markers but reads no call reports a malformed call (the Gemma 4 syntax first; real
tokenizer, real templates from tests/data, episodes through the real loop on a scripted generator)."""

import asyncio
import inspect
import re
import warnings

import pytest
from transformers import AutoTokenizer

import agent_loop.episode.parsers as p
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.chat import ChatFormatter, TemplateError
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tool_formats import TOOL_FORMATS, parser_for_template
from agent_loop.episode.tools import ToolExecutor
from masking import SpanKind
from tests.helpers.echo_task import EchoTask, echo  # the same one-tool task
from tests.helpers.testdata import qwen_tokenizer_dir, read_template


def play(tok, replies, marker, config=None):
    """Reply k when the prompt holds ``marker`` k + 1 times (k-th generation prompt)."""
    def script(prompt_ids):
        turn = tok.decode(prompt_ids).count(marker) - 1
        return tok.encode(replies[min(turn, len(replies) - 1)], add_special_tokens=False)
    return asyncio.run(run_episode(EchoTask(), 0, ScriptedBackend(script), tok, config or LoopConfig()))


# -- a template that numbers tool results with its own counter -----------------------------------------------

QWEN = read_template("qwen2.5-7b-instruct.jinja")
RESULT = "{{- '\\n<tool_response>\\n' }}"
COUNTING = "{%- set ns = namespace(n=0) %}\n" + QWEN.replace(  # 1, 2, 3, ... in the order of the chat
    RESULT, "{%- set ns.n = ns.n + 1 %}{{- '\\n<tool_response>\\n{\"tool_call_id\": \"' ~ ns.n ~ '\"}\\n' }}")
TOTAL = ("{%- set total = messages | selectattr('role', 'equalto', 'tool') | list | length %}\n"  # every result: the count
         + QWEN.replace(RESULT, "{{- '\\n<tool_response>\\n{\"tool_call_id\": \"' ~ total ~ '\"}\\n' }}"))
CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "%s"}}\n</tool_call><|im_end|>'
TURN = "<|im_start|>assistant"


def qwen_with(template: str):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.chat_template = template
    return tok


def observation_text(tok, traj, turn: int) -> str:
    return tok.decode([i for i, s, t in zip(traj.response_ids, traj.spans, traj.turn_ids)
                       if s == SpanKind.OBSERVATION and t == turn], skip_special_tokens=False)


def test_a_counter_that_only_appends_is_reproduced_exactly():
    """Results numbered 1, 2 over the chat: the second observation says "2", as the one-go render does, and the
    episode's whole token text is the one-go render of its messages."""
    assert COUNTING != QWEN and TOTAL != QWEN
    tok = qwen_with(COUNTING)
    traj = play(tok, [CALL % "a", CALL % "b", "done<|im_end|>"], TURN)
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]
    assert '"tool_call_id": "1"' in observation_text(tok, traj, 0)
    assert '"tool_call_id": "2"' in observation_text(tok, traj, 1)
    one_go = tok.apply_chat_template(traj.messages, tools=ToolExecutor([echo]).schemas, tokenize=False)
    played = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert one_go.startswith(played.removesuffix("<|im_end|>")) and one_go == played + "\n"


def test_a_counter_that_rewrites_earlier_results_is_refused_up_front_with_the_reason():
    """Every result says the count of results in the chat: "1" after one round, but the one-go render of two
    rounds says "2" for the first one too. One round of tool results is append-only, two are not: strict
    refuses at the first observation (before any second round is played), naming the round-to-round rewrite."""
    tok = qwen_with(TOTAL)
    formatter = ChatFormatter(tok, tools=ToolExecutor([echo]).schemas)
    with pytest.raises(TemplateError, match=r"not append-only across rounds.*tool_call_id.*\"1\".*\"2\".*keep_seen"):
        formatter.observation_ids([{"role": "tool", "name": "echo", "tool_call_id": "call00000", "content": "a"}])
    with pytest.raises(TemplateError, match="not append-only across rounds"):  # an episode with one tool round
        play(tok, [CALL % "a", "done<|im_end|>"], TURN)
    # keep_seen runs it: the tokens the model saw, the drift at the second round recorded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traj = play(tok, [CALL % "a", CALL % "b", "done<|im_end|>"], TURN, LoopConfig(history_mode="keep_seen"))
    assert traj.finish_reason == "stop" and traj.metrics["template_drift"] >= 1
    assert traj.metrics["template_first_diff"]["turn"] == 1
    assert '"tool_call_id": "1"' in observation_text(tok, traj, 0)  # what the model saw after round one


# -- parsers that see their own markers ---------------------------------------------------------------------

GEMMA_CALLS = [
    # (model text, the calls read, how many malformed)
    ('<|tool_call>call:echo{text:<|"|>a<|"|>}<tool_call|>', [("echo", {"text": "a"})], 0),
    ('<|tool_call>call:echo {text: <|"|>a}b<|"|>, n : 2}<tool_call|>', [("echo", {"text": "a}b", "n": 2})], 0),
    ('<|tool_call>call:f{x:[1, {y:true}], z:<|"|><|"|>}<tool_call|>', [("f", {"x": [1, {"y": True}], "z": ""})], 0),
    ('<|tool_call>echo{text:<|"|>a<|"|>}<tool_call|>', [], 1),  # no "call:"
    ('<|tool_call>call:echo{text:<|"|>a}<tool_call|>', [], 1),  # an unclosed string
    ('<|tool_call>call:echo{text:[1,2}<tool_call|>', [], 1),  # a list closed by }
    ('<|tool_call>call:echo{text:[1,2', [], 1),  # cut short (was an endless loop)
    ('<|tool_call>call:echo(text="a")<tool_call|>', [], 1),  # another family's syntax inside Gemma's markers
    ('<|tool_call>call:a{}<tool_call|> and <|tool_call>call:b{x:}<tool_call|>', [("a", {})], 1),  # the second not lost
    ('<|tool_call>call:echo{text:<|"|>a<|"|>} junk<tool_call|>', [], 1),
    ("no call here", [], 0),
]


GEMMA_CALLS += [  # the format's closing and string markers without an opening one (issue 40 item 20)
    ('Here: call:echo{text:<|"|>a<|"|>}<tool_call|>', [], 1),
    ("done <tool_call|>", [], 1),
    ('the text <|"|>a<|"|>', [], 1),
    ("call:echo{text:<escape>a<escape>}<end_function_call>", [], 1),
]


def row(name: str):
    return next(f for f in TOOL_FORMATS if f.name == name)


@pytest.mark.parametrize(("text", "calls", "errors"), GEMMA_CALLS)
def test_gemma_every_opened_call_is_read_or_reported(text, calls, errors):
    turn = row("gemma").parser(text)
    assert [(c.name, c.arguments) for c in turn.calls] == calls
    assert len(turn.errors) == errors
    assert all(e.raw and e.error for e in turn.errors)
    assert "<|tool_call>" not in turn.content  # the calls are not left in the content either


MARKED_BUT_UNREADABLE = {  # a turn holding the format's own opening marker, from which no call can be read
    "qwen3_xml": "<function=echo>a</function>",  # the function block outside <tool_call>
    "llama3_json": "<|python_tag|>print(1)",
    "deepseek": "<｜tool▁calls▁begin｜>echo a<｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|>echo<|tool_calls_section_end|>",
    "harmony": "to=functions.echo but no message",
    "pythonic": "<|python_start|>echo<|python_end|>",
}


@pytest.mark.parametrize("name", sorted(MARKED_BUT_UNREADABLE))
def test_a_parser_that_sees_its_markers_but_reads_no_call_reports_a_malformed_call(name):
    row = next(f for f in TOOL_FORMATS if f.name == name)
    turn = row.parser(MARKED_BUT_UNREADABLE[name])
    assert turn.calls == [] and len(turn.errors) == 1, turn
    assert turn.errors[0].error.startswith("malformed tool call: the turn contains")
    assert turn.errors[0].raw == MARKED_BUT_UNREADABLE[name]
    # text without any marker stays a final answer, in every format (Functionary's text turns start "all\n")
    for f in TOOL_FORMATS:
        plain = f.parser("all\nThe answer is 5." if f.name == "functionary" else "The answer is 5.")
        assert plain.calls == [] and plain.errors == [], f.name


def test_call_markers_are_declared_once_in_the_table_and_the_parsers_read_them():
    """Issue 37 item 7: the markers lived in a parser decorator and in the table, and drifted (glm45 ``<arg_key>``,
    pythonic ``<|python_start|>``): a pythonic turn with an unparsed call counted as a final answer. Now every
    marker of a row makes its parser report a turn that holds it and yields no call, and the final-answer
    rule refuses the same turn."""
    from agent_loop.tasks.rewards import final_answer

    assert not any(hasattr(f, "call_markers") for f in vars(p).values() if callable(f))  # none left in parsers.py
    for f in TOOL_FORMATS:
        for marker in f.call_markers:
            text = f"The answer is {marker} 5."
            turn = f.parser(text)
            assert turn.calls or turn.errors, (f.name, marker)
            assert final_answer([{"role": "assistant", "content": text}], f) == "", (f.name, marker)
    for name, text in (("glm45", "echo<arg_key>text</arg_key>"), ("pythonic", "<|python_start|>echo(")):
        turn = row(name).parser(text)
        assert turn.calls == [] and len(turn.errors) == 1 and text in turn.errors[0].raw
        assert final_answer([{"role": "assistant", "content": text}], row(name)) == ""


GEMMA_MARKERS = re.compile(r'<\|[a-z_]+>|<[a-z_]+\|>|<\|"\|>')


def test_a_malformed_gemma4_call_in_an_episode_is_an_error_observation_not_a_final_answer():
    """The real Gemma 4 template (keep_seen: strict refuses its thinking generation prompt): a call without
    ``call:`` is answered with a malformed-call error and the model gets another turn."""
    template = read_template("vllm_tool_chat_template_gemma4.jinja")
    assert inspect.unwrap(parser_for_template(template)) is p.parse_gemma
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": sorted(set(GEMMA_MARKERS.findall(template)))},
                           replace_extra_special_tokens=False)
    tok.chat_template = template
    replies = ['<|tool_call>echo{text:<|"|>a<|"|>}<tool_call|><|tool_response>', "done<turn|>"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traj = play(tok, replies, "<|turn>model", LoopConfig(history_mode="keep_seen"))
    assert traj.metrics["tool_errors"] == {"malformed_json": 1}
    assert traj.metrics["turns"] == 2 and traj.finish_reason == "stop" and traj.reward == 1.0
    assert "call:NAME{key:value,...}" in traj.tool_calls[0].error  # what the model reads back: the expected form


GEMMA4_CALL = 'call:echo{text:<|"|>Paris<|"|>}<tool_call|>'


@pytest.mark.parametrize("text, calls, content", [
    ("I will look it up." + GEMMA4_CALL, [], "I will look it up."),  # the only call lacks its opener
    ('<|tool_call>call:echo{text:<|"|>a<|"|>}<tool_call|>' + GEMMA4_CALL, [p.ParsedCall("echo", {"text": "a"})], ""),
])
def test_a_gemma4_call_without_its_opener_is_a_malformed_call_naming_the_opener(text, calls, content):
    """Issue 49 item 6: a call that closes with <tool_call|> but never opened is a ParseError naming the missing
    <|tool_call>, holding its text from ``call:`` on; beside a well-formed call it is not dropped into the content
    (before: 1 call and no error, the second call silently gone), and its text never passes as content."""
    turn = parser_for_template(read_template("vllm_tool_chat_template_gemma4.jinja"))(text)
    assert turn.calls == calls and turn.content == content
    assert [e.raw for e in turn.errors] == [GEMMA4_CALL]
    assert "without its opener <|tool_call>" in turn.errors[0].error
    assert "<|tool_call>call:NAME{key:value,...}<tool_call|>" in turn.errors[0].error


def test_a_gemma4_call_without_its_opener_in_an_episode_tells_the_model_the_missing_opener():
    """The same call sampled in an episode on the real Gemma 4 template: answered with a malformed-call error
    that names the opener (what the model reads back), the turn kept as sampled, and the model gets another turn."""
    template = read_template("vllm_tool_chat_template_gemma4.jinja")
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": sorted(set(GEMMA_MARKERS.findall(template)))},
                           replace_extra_special_tokens=False)
    tok.chat_template = template
    replies = ["Checking." + GEMMA4_CALL + "<|tool_response>", "done<turn|>"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traj = play(tok, replies, "<|turn>model", LoopConfig(history_mode="keep_seen"))
    assert traj.metrics["tool_errors"] == {"malformed_json": 1}
    assert traj.metrics["turns"] == 2 and traj.finish_reason == "stop" and traj.reward == 1.0
    assert "without its opener <|tool_call>" in traj.tool_calls[0].error
    assert traj.messages[-3]["content"].endswith(GEMMA4_CALL) and "tool_calls" not in traj.messages[-3]
