"""Template exactness in the loop: observations from the episode's own messages, mismatch and drift records,
the keep_seen opt-in mode, and tool-call ids unique in the episode (real tokenizer, real templates)."""

import asyncio
import json
import warnings

import pytest
from transformers import AutoTokenizer

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.chat import ChatFormatter, TemplateError
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tools import ToolExecutor
from tests.helpers.echo_task import EchoTask, echo
from tests.helpers.testdata import qwen_tokenizer_dir, read_template

DS = {"calls": "<｜tool▁calls▁begin｜>", "call": "<｜tool▁call▁begin｜>", "sep": "<｜tool▁sep｜>",
      "end": "<｜tool▁call▁end｜>", "calls_end": "<｜tool▁calls▁end｜>", "eos": "<｜end▁of▁sentence｜>"}


def tokenizer_with(template: str):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": [v for v in DS.values()] + ["<｜User｜>", "<｜Assistant｜>"]},
                           replace_extra_special_tokens=False)
    tok.chat_template = template
    return tok


def ds_call(text: str) -> str:
    return (f"{DS['calls']}{DS['call']}function{DS['sep']}echo\n```json\n{json.dumps({'text': text})}\n```"
            f"{DS['end']}{DS['calls_end']}{DS['eos']}")


def play(tok, replies, marker, config=None, first=1):
    """Reply k when the prompt holds ``marker`` k + ``first`` times."""
    def script(prompt_ids):
        turn = tok.decode(prompt_ids).count(marker) - first
        return tok.encode(replies[min(turn, len(replies) - 1)], add_special_tokens=False)
    return asyncio.run(run_episode(EchoTask(), 0, ScriptedBackend(script), tok, config or LoopConfig()))


def test_conversation_global_state_is_exact_in_the_loop():
    """R1-distill (2025-02-04) opens <｜tool▁outputs▁begin｜> only for the first tool-output group: the
    observation of the second group differs from a fixed synthetic prefix's, and the loop gets it right."""
    tok = tokenizer_with(read_template("deepseek-r1-distill-qwen-32b.2025-02-04.jinja"))
    # after tool outputs this template writes no generation prompt: count the closed tool-output groups
    traj = play(tok, [ds_call("a"), ds_call("b"), "done" + DS["eos"]], "<｜tool▁outputs▁end｜>", first=0)
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    assert traj.metrics["template_exact"] and traj.metrics["template_mismatch"] == 0
    assert traj.metrics["template_first_diff"] is None
    # each observation is a piece of the one-go render of the episode's messages
    full = tok.apply_chat_template(traj.messages, tools=ToolExecutor([echo]).schemas, tokenize=False)
    observations = [tok.decode([i for i, s, t in zip(traj.response_ids, traj.spans, traj.turn_ids) if s == 2 and t == turn],
                               skip_special_tokens=False) for turn in (0, 1)]
    assert all(o and o in full for o in observations)
    assert observations[0].startswith("<｜tool▁outputs▁begin｜>") and "outputs▁begin" not in observations[1]
    # a fixed synthetic prefix would give the second group the first's opener: the probe finds that, and
    # observation_ids (which renders after such a prefix) refuses, naming it (issue 49 item 5)
    formatter = ChatFormatter(tok, tools=ToolExecutor([echo]).schemas)
    assert "depends on the conversation before it" in formatter.history_dependence(traj.messages[-2:-1])
    with pytest.raises(TemplateError, match="outputs▁begin.*cannot give them: use ChatFormatter.observation"):
        formatter.observation_ids(traj.messages[-2:-1])


def test_call_ids_are_unique_in_the_episode(qwen_tokenizer):
    call = '<tool_call>\n{"name": "echo", "arguments": {"text": "x"}}\n</tool_call>'
    def script(prompt_ids):
        turn = qwen_tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return qwen_tokenizer.encode([call + call + "<|im_end|>", call + "<|im_end|>", "done<|im_end|>"][min(turn, 2)])
    traj = asyncio.run(run_episode(EchoTask(), 0, ScriptedBackend(script), qwen_tokenizer, LoopConfig()))
    ids = [r.call_id for r in traj.tool_calls]
    assert ids == ["call00000", "call00001", "call00002"]
    assert [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"] == ids
    assert [c["id"] for m in traj.messages for c in m.get("tool_calls", [])] == ids


def test_kimi_k2_ids_are_functions_name_idx_and_shown_to_the_model():
    """Kimi K2 shows each result's id ("## Return of ID"): ids are unique in the episode, in Kimi's format."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    kimi = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
    tok.add_special_tokens({"additional_special_tokens": kimi}, replace_extra_special_tokens=False)
    tok.chat_template = read_template("kimi-k2-thinking.jinja")

    def call(i, text):
        return (f"<|tool_call_begin|>functions.echo:{i}<|tool_call_argument_begin|>{json.dumps({'text': text})}"
                "<|tool_call_end|>")
    replies = [f"<think></think><|tool_calls_section_begin|>{call(0, 'a')}{call(1, 'b')}<|tool_calls_section_end|><|im_end|>",
               f"<think></think><|tool_calls_section_begin|>{call(2, 'c')}<|tool_calls_section_end|><|im_end|>",
               "<think></think>done<|im_end|>"]
    traj = play(tok, replies, "<|im_assistant|>assistant<|im_middle|>")
    assert traj.finish_reason == "stop" and traj.metrics["template_exact"]
    assert [r.call_id for r in traj.tool_calls] == ["functions.echo:0", "functions.echo:1", "functions.echo:2"]
    text = tok.decode(traj.response_ids, skip_special_tokens=False)
    assert [text.count(f"## Return of functions.echo:{i}\n") for i in range(3)] == [1, 1, 1]


def test_glm_turn_ends_on_the_next_roles_token_kept_in_the_assistant_span():
    """GLM-4.5/4.6 write no end-of-turn token: the model stops on <|observation|> (tool call) or <|user|>;
    that token is sampled, so it is ASSISTANT; the observation starts right after it."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]},
                           replace_extra_special_tokens=False)
    tok.chat_template = read_template("glm-4.6.jinja")
    formatter = ChatFormatter(tok, tools=ToolExecutor([echo]).schemas)
    stops = tok.convert_ids_to_tokens(formatter.end_of_turn_ids)
    assert stops[:2] == ["<|user|>", "<|observation|>"] and formatter.stop_opens_next_turn
    call = "\n<think></think>\n<tool_call>echo\n<arg_key>text</arg_key>\n<arg_value>a</arg_value>\n</tool_call><|observation|>"
    traj = play(tok, [call, "\n<think></think>\ndone<|user|>"], "<|assistant|>")
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]
    observation_token = tok.convert_tokens_to_ids("<|observation|>")
    at = traj.response_ids.index(observation_token)
    assert traj.spans[at] == 1 and traj.spans[at + 1] == 2  # ASSISTANT stop token, then OBSERVATION
    obs = tok.decode([i for i, s in zip(traj.response_ids, traj.spans) if s == 2], skip_special_tokens=False)
    assert obs == "\n<tool_response>\na\n</tool_response><|assistant|>"


def test_mismatch_names_the_first_differing_position(qwen_tokenizer):
    formatter = ChatFormatter(qwen_tokenizer)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    _, seen = formatter.prompt(history[:1])
    tampered = seen.replace("hi", "HI")
    obs = formatter.observation(history, tampered, [{"role": "user", "content": "again"}],
                                stop_id=formatter.end_of_turn_ids[0], sampled="yo")
    assert obs.mismatch is not None and obs.mismatch["char"] == seen.index("hi")
    assert qwen_tokenizer.decode(obs.ids).endswith("again<|im_end|>\n<|im_start|>assistant\n")
    exact = formatter.observation(history, seen, [{"role": "user", "content": "again"}],
                                  stop_id=formatter.end_of_turn_ids[0], sampled="yo")
    assert exact.mismatch is None and exact.ids == obs.ids


def test_history_rewriting_template_strict_refuses_keep_seen_runs_and_records_drift():
    """QwQ drops a tool-calling turn's reasoning once its results follow: strict refuses with that reason;
    keep_seen keeps the tokens the model saw, appends the template's observation, records drift, warns once."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.chat_template = read_template("qwq-32b.jinja")
    reply = ('I think.\n</think>\n\n<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call><|im_end|>')
    replies = [reply, reply, "</think>\n\ndone<|im_end|>"]
    with pytest.raises(TemplateError, match="rewrites the earlier text.*keep_seen"):
        play(tok, replies, "<|im_start|>assistant")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traj = play(tok, replies, "<|im_start|>assistant", LoopConfig(history_mode="keep_seen"))
    assert sum("keep_seen" in str(w.message) for w in caught) == 1
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    # two observations and the final answer (its <think> generation prompt is not how the answer renders)
    assert not traj.metrics["template_exact"] and traj.metrics["template_drift"] == 3
    assert traj.metrics["template_mismatch"] == 0 and traj.metrics["template_first_diff"]["turn"] == 0
    # the model's own reasoning tokens are kept; each observation is the template's text after the episode's messages
    text = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert text.count("I think.") == 2 and text.count("<tool_response>\na\n</tool_response>") == 2


def test_mismatch_setting_makes_it_an_error_and_is_validated(qwen_tokenizer):
    """on_template_mismatch="error": the finished episode's one-go render is checked too (here QwQ, whose
    generation prompt opens <think> that the rendered final answer drops: recorded by default, an error on request)."""
    with pytest.raises(ValueError, match="on_template_mismatch"):
        LoopConfig(on_template_mismatch="ignore")
    with pytest.raises(ValueError, match="history_mode"):
        LoopConfig(history_mode="lenient")
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.chat_template = read_template("qwq-32b.jinja")  # refused up front in strict mode ...
    reply = "</think>\n\ndone<|im_end|>"  # ... but a chat with no tool call never reaches the probe
    traj = play(tok, [reply], "<|im_start|>assistant")
    assert traj.metrics["template_mismatch"] == 1 and traj.metrics["template_first_diff"]["turn"] == 0
    with pytest.raises(TemplateError, match="differs from the tokens the model saw"):
        play(tok, [reply], "<|im_start|>assistant", LoopConfig(on_template_mismatch="error"))


def test_command_r7b_numbers_calls_across_the_chat_and_looks_results_up_by_id():
    """Command R7B numbers calls over the whole chat and finds each result's number by its call id: with ids
    unique in the episode the second turn's result is "2" (ids restarting per turn would make it "0")."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    cohere = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|USER_TOKEN|>", "<|SYSTEM_TOKEN|>",
              "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>",
              "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]
    tok.add_special_tokens({"bos_token": "<BOS_TOKEN>", "additional_special_tokens": cohere}, replace_extra_special_tokens=False)
    tok.chat_template = read_template("command-r7b-12-2024-tool_use.jinja")
    formatter = ChatFormatter(tok, tools=ToolExecutor([echo]).schemas)
    # two special tokens after a turn: the stop token is the last one the model writes (class 4)
    assert tok.convert_ids_to_tokens(formatter.end_of_turn_ids[:1]) == ["<|END_OF_TURN_TOKEN|>"]

    def action(*texts):
        calls = ",\n".join(f'    {{"tool_call_id": "{i}", "tool_name": "echo", "parameters": {{"text": "{t}"}}}}'
                           for i, t in enumerate(texts))
        return f"<|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n{calls}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>"
    replies = [action("a", "b"), action("c"), "<|START_RESPONSE|>done<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]
    traj = play(tok, replies, "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]
    assert [r.call_id for r in traj.tool_calls] == ["call00000", "call00001", "call00002"]
    second = tok.decode([i for i, s, t in zip(traj.response_ids, traj.spans, traj.turn_ids) if s == 2 and t == 1],
                        skip_special_tokens=False)
    assert '"tool_call_id": "2"' in second and '"0": "c"' in second


COHERE_TOKENS = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|USER_TOKEN|>",
                 "<|SYSTEM_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
                 "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]


@pytest.mark.parametrize("rounds", [(1, 1, 1), (2, 1), (1, 2), (2, 2, 2), (1, 1, 1, 1)],
                         ids=lambda r: "+".join(map(str, r)))
def test_command_r7b_real_template_played_episode_is_its_one_go_render(rounds):
    """Issue 40 item 19, on the real Command R7B tool-use template (not a synthetic counting one): the model
    writes each turn as the template renders it (calls numbered over the whole chat), and the played episode's
    whole token text, every observation included, is the one-go render of its messages (less the generation
    prompt the template always appends); each result's "tool_call_id" is its call's number in the chat."""
    import re

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.add_special_tokens({"bos_token": "<BOS_TOKEN>", "additional_special_tokens": COHERE_TOKENS},
                           replace_extra_special_tokens=False)
    tok.chat_template = read_template("command-r7b-12-2024-tool_use.jinja")
    replies, number = [], 0
    for k, calls in enumerate(rounds):
        listed = ",\n".join(f'    {{"tool_call_id": "{number + i}", "tool_name": "echo", "parameters": {{"text": "{k}-{i}"}}}}'
                            for i in range(calls))
        number += calls
        replies.append(f"<|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n{listed}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>")
    replies.append("<|START_RESPONSE|>done<|END_RESPONSE|><|END_OF_TURN_TOKEN|>")
    traj = play(tok, replies, "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", LoopConfig(max_turns=len(rounds) + 1))
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]
    assert not traj.metrics.get("template_mismatch") and not traj.metrics.get("template_drift")
    one_go = tok.apply_chat_template(traj.messages, tools=ToolExecutor([echo]).schemas, tokenize=False)
    played = tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert one_go == played + "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"  # token for token, not only the flag
    assert tok.encode(one_go, add_special_tokens=False)[: len(traj.prompt_ids) + len(traj.response_ids)] == \
        traj.prompt_ids + traj.response_ids
    first = 0
    for turn, calls in enumerate(rounds):  # each round's results carry the numbers of its calls in the chat
        seen = tok.decode([i for i, s, t in zip(traj.response_ids, traj.spans, traj.turn_ids) if s == 2 and t == turn],
                          skip_special_tokens=False)
        assert re.findall(r'"tool_call_id": "(\d+)"', seen) == [str(first + i) for i in range(calls)], seen
        first += calls
