"""Tool-call formats of the 2025-2026 families (issue 56 item 6), each on its real template from
``tests/data/chat_templates`` (see SOURCES.md): a pythonic call list after text (LFM2), the Qwen3-Coder XML form
inside a family tag (Seed-OSS), a Mistral template whose eos the tokenizer does not know as a special token, and
a final answer sampled with one end marker and rendered with another (Solar Open's ``<|flush|>`` / ``<|end|>``)."""

import copy

import pytest
from test_chat_templates import CALCULATOR, tokenizer  # noqa: F401 (fixture)

from agent_loop.episode.chat import ChatFormatter, TemplateError
from agent_loop.episode.tool_formats import find_tool_format, parser_for_template
from tests.helpers.testdata import read_template

ANSWER = "<|content|>It is 5."  # a Solar Open final answer as sampled after its generation prompt
LFM2 = ("lfm2.5-8b-a1b.jinja", "lfm2-8b-a1b.jinja")


@pytest.mark.parametrize("name", LFM2)
def test_lfm2_call_list_after_text_is_read(name):
    parse = parser_for_template(read_template(name))
    turn = parse("Let me compute that.<|tool_call_start|>[calculator(expression='2+3', options={\"exact\": true}), "
                 "lookup(key='x', missing=None)]<|tool_call_end|>")
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "2+3", "options": {"exact": True}}), ("lookup", {"key": "x", "missing": None})]
    assert turn.content == "Let me compute that." and not turn.errors


def test_lfm2_broken_call_list_is_malformed_not_an_answer():
    parse = parser_for_template(read_template("lfm2.5-8b-a1b.jinja"))
    turn = parse("Checking.<|tool_call_start|>[calculator(expression='2+3'<|tool_call_end|>")
    assert not turn.calls and len(turn.errors) == 1 and "malformed pythonic" in turn.errors[0].error
    plain = parse("The answer is 5.")
    assert plain.content == "The answer is 5." and not plain.calls and not plain.errors


def test_seed_oss_calls_in_the_family_tag_are_read():
    template = read_template("bytedance-seed-oss.jinja")
    assert find_tool_format(template).name == "seed_oss"
    parse = parser_for_template(template, [CALCULATOR])
    turn = parse("I will compute it.<seed:tool_call>\n<function=calculator>\n<parameter=expression>2+3</parameter>\n"
                 "</function>\n</seed:tool_call><seed:tool_call>\n<function=calculator>\n<parameter=expression>4"
                 "</parameter>\n</function>\n</seed:tool_call>")
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2+3"}),
                                                           ("calculator", {"expression": "4"})]  # string-typed
    assert turn.content == "I will compute it." and not turn.errors
    broken = parse("<seed:tool_call>\n<function calculator>\n</seed:tool_call>")
    assert not broken.calls and "<function=NAME>" in broken.errors[0].error


def test_solar_open_calls_are_read():
    parse = parser_for_template(read_template("solar-open-100b.jinja"))
    turn = parse('Checking.<|tool_calls|><|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>calculator<|tool_call:args|>'
                 '{"expression": "2+3"}<|tool_call:end|>')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2+3"})]
    assert turn.content == "Checking." and not turn.errors
    broken = parse("<|tool_calls|><|tool_call:begin|>calculator{}<|tool_call:end|>")
    assert not broken.calls and "<|tool_call:name|>" in broken.errors[0].error


def with_eos(base, eos: str):
    """A copy of the tokenizer ``base`` whose eos is ``eos``, a special token."""
    copied = copy.deepcopy(base)
    copied.add_special_tokens({"eos_token": eos})
    return copied


def test_mistral_eos_the_tokenizer_cannot_stop_on_is_refused(tokenizer):  # noqa: F811
    """Mistral v13 ends an assistant turn with its eos_token; ``</s>`` is plain text in this vocabulary, so the next
    special token (``[TOOL_RESULTS]``) would be taken for the turn's end: refused, naming the eos."""
    assert tokenizer.encode("</s>", add_special_tokens=False) != [tokenizer.convert_tokens_to_ids("</s>")]
    with pytest.raises(TemplateError, match="ends an assistant turn with its eos_token '</s>', which this tokenizer "
                                            "does not encode as one special token"):
        ChatFormatter(tokenizer, tools=[CALCULATOR], chat_template=read_template("mistral-common_v13.jinja"),
                      bos_token="", eos_token="</s>")


def test_mistral_eos_the_tokenizer_knows_builds_one_tool_results_block(tokenizer):  # noqa: F811
    mistral = with_eos(tokenizer, "</s>")
    formatter = ChatFormatter(mistral, tools=[CALCULATOR], chat_template=read_template("mistral-common_v13.jinja"),
                              bos_token="")
    assert formatter.end_of_turn_ids == [mistral.eos_token_id]
    result = {"role": "tool", "name": "calculator", "tool_call_id": "call00000", "content": "5"}
    assert mistral.decode(formatter.observation_ids([result])) == "[TOOL_RESULTS]5[/TOOL_RESULTS]"


def _solar(tokenizer, history_mode: str) -> tuple[ChatFormatter, list[dict], str, int, int]:  # noqa: F811
    solar = with_eos(tokenizer, "<|flush|>")  # Solar Open's eos, which its template never writes
    formatter = ChatFormatter(solar, tools=[CALCULATOR], chat_template=read_template("solar-open-100b.jinja"),
                              history_mode=history_mode, bos_token="")
    assert solar.eos_token_id in formatter.end_of_turn_ids
    head = [{"role": "user", "content": "What is 2+3?"}]
    seen = formatter.render_text(head, add_generation_prompt=True)
    flush, end = (solar.convert_tokens_to_ids(t) for t in ("<|flush|>", "<|end|>"))
    return formatter, head + [{"role": "assistant", "content": "It is 5."}], seen, flush, end


def test_final_answer_sampled_with_another_end_marker_is_refused(tokenizer):  # noqa: F811
    formatter, messages, seen, flush, end = _solar(tokenizer, "strict")
    assert formatter.final_rerender(messages, seen, ANSWER, end) is None  # ended as the template renders it
    with pytest.raises(TemplateError, match="ended its turn with '<\\|flush\\|>', which this chat template renders as "
                                            "'<\\|end\\|>'"):
        formatter.final_rerender(messages, seen, ANSWER, flush)


def test_final_answer_with_another_end_marker_is_recorded_in_keep_seen(tokenizer):  # noqa: F811
    formatter, messages, seen, flush, _ = _solar(tokenizer, "keep_seen")
    diff = formatter.final_rerender(messages, seen, ANSWER, flush)
    assert diff == {"char": len(ANSWER), "sampled": "<|flush|>", "rendered": "<|end|>"}


def test_tool_call_turn_stopped_on_another_marker_keeps_its_results_and_records_the_mismatch(tokenizer):  # noqa: F811
    """A Solar Open call turn that the model ends with ``<|end|>`` (the template writes ``<|calls|>``): the observation
    starts after the turn's own end, so the results stay in the context, and the mismatch is recorded."""
    formatter, messages, seen, _, end = _solar(tokenizer, "keep_seen")
    call = {"id": "call00000", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    history = messages[:1] + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    sampled = ('<|tool_calls|><|tool_call:begin|>call00000<|tool_call:name|>calculator<|tool_call:args|>'
               '{"expression": "2+3"}<|tool_call:end|>')
    assert formatter.render_text(history).startswith(seen + sampled + "<|calls|>")
    result = {"role": "tool", "name": "calculator", "tool_call_id": "call00000", "content": "5"}
    obs = formatter.observation(history, seen, [result], end, sampled)
    assert obs.mismatch is not None and (obs.mismatch["seen"], obs.mismatch["fresh"]) == ("<|end|>", "<|calls|>")
    text = formatter.tokenizer.decode(obs.ids)
    assert text.startswith("<|begin|>tool<|tool_response|><|tool_response:begin|>call00000") and "result|>5<" in text


@pytest.mark.parametrize("name, prefix, block", [("minimax-m2.jinja", "", "minimax:tool_call"),
                                                 ("deepseek-v3.2.jinja", "｜DSML｜", "｜DSML｜function_calls")])
def test_invoke_calls_are_read_with_string_and_typed_values(name, prefix, block):
    parse = parser_for_template(read_template(name), [CALCULATOR])
    turn = parse(f'Let me check.\n\n<{block}>\n<{prefix}invoke name="calculator">\n<{prefix}parameter name="expression">'
                 f'12</{prefix}parameter>\n<{prefix}parameter name="n">3</{prefix}parameter>\n</{prefix}invoke>\n</{block}>')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "12", "n": 3})]
    assert turn.content == "Let me check." and not turn.errors
    broken = parse(f"<{block}>\n<{prefix}invoke calculator>\n</{block}>")
    assert not broken.calls and "invoke name=" in broken.errors[0].error
