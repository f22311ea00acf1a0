"""Command R7B's planned tool-call turns on its real tool-use template (issue 40 item 19): the plan the model
writes in ``<|START_THINKING|>`` is the turn's ``reasoning_content``, which is what the template renders there (it
does not render a tool-call turn's content), so a played episode is its one-go render token for token; a shape
the template cannot render as sampled (a call without the plan markers it always writes) is reported per turn."""

import asyncio
import re

import pytest
from transformers import AutoTokenizer

import agent_loop.episode.parsers as P
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.chat import ChatFormatter, TemplateError
from agent_loop.episode.loop import run_episode
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.tool_formats import ToolFormat
from agent_loop.episode.tools import ToolExecutor
from tests.helpers.echo_task import EchoTask, echo
from tests.helpers.testdata import qwen_tokenizer_dir, read_template

COHERE_TOKENS = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|USER_TOKEN|>",
                 "<|SYSTEM_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
                 "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"]
GENERATION_PROMPT = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
# plans as a model writes them: a sentence, none at all (empty markers), several lines with edge whitespace
PLANS = ["I will echo the first text, then answer.", "", "\nStep 1: echo again.\nStep 2: answer.  "]
ANSWER = "<|START_RESPONSE|>done<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"


@pytest.fixture(scope="module")
def cohere_tokenizer():
    """The tokenizer the Command R tests use (Qwen2.5's, with Command R7B's markers as special tokens) and the real
    Command R7B tool-use template."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tok.add_special_tokens({"bos_token": "<BOS_TOKEN>", "additional_special_tokens": COHERE_TOKENS},
                           replace_extra_special_tokens=False)
    tok.chat_template = read_template("command-r7b-12-2024-tool_use.jinja")
    return tok


def action(first: int, calls: int, round_: int, plan: str | None) -> str:
    """A tool-call turn as the template renders it: the plan markers (unless ``plan`` is None), then the calls
    numbered over the whole chat from ``first``."""
    listed = ",\n".join(f'    {{"tool_call_id": "{first + i}", "tool_name": "echo", "parameters": {{"text": "{round_}-{i}"}}}}'
                        for i in range(calls))
    head = "" if plan is None else f"<|START_THINKING|>{plan}<|END_THINKING|>"
    return f"{head}<|START_ACTION|>[\n{listed}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>"


def play(tok, replies: list[str]):
    """Reply k at the k-th generation prompt of the episode (a scripted generator: the loop's logic only)."""
    def script(prompt_ids):
        turn = tok.decode(prompt_ids).count(GENERATION_PROMPT) - 1
        return tok.encode(replies[min(turn, len(replies) - 1)], add_special_tokens=False)
    config = LoopConfig(max_turns=len(replies))
    return asyncio.run(run_episode(EchoTask(), 0, ScriptedBackend(script), tok, config))


def played_and_one_go(tok, traj) -> tuple[list[int], list[int]]:
    """The played episode's ids and the one-go render's ids of its messages (less the generation prompt the
    template always appends)."""
    one_go = tok.apply_chat_template(traj.messages, tools=ToolExecutor([echo]).schemas, tokenize=False)
    assert one_go.endswith(GENERATION_PROMPT)
    return traj.prompt_ids + traj.response_ids, tok.encode(one_go.removesuffix(GENERATION_PROMPT), add_special_tokens=False)


@pytest.mark.parametrize("rounds", [(1,), (2, 1), (1, 2, 1)], ids=lambda r: "+".join(map(str, r)))
def test_planned_tool_call_turns_play_as_their_one_go_render(cohere_tokenizer, rounds):
    """Each tool-call turn carries a plan (one of them empty); the played episode, planned turns, observations and
    final answer included, is the one-go render of its messages token for token, and every plan is recorded
    exactly as ``reasoning_content`` (the key vLLM, verl and TRL read), with no marker left in any content."""
    tok, replies, first = cohere_tokenizer, [], 0
    for k, calls in enumerate(rounds):
        replies.append(action(first, calls, k, PLANS[k]))
        first += calls
    traj = play(tok, replies + [ANSWER])
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    assert traj.metrics["template_exact"] and traj.metrics["template_mismatch"] == 0
    assert traj.metrics["template_rerender_diffs"] == 0 and traj.metrics["template_rerender_first"] is None
    played, one_go = played_and_one_go(tok, traj)
    assert played == one_go
    turns = [m for m in traj.messages if m["role"] == "assistant"]
    assert [m.get("reasoning_content") for m in turns] == PLANS[: len(rounds)] + [None]
    assert [m["content"] for m in turns] == [""] * len(rounds) + ["done"]
    assert [len(m.get("tool_calls", [])) for m in turns] == [*rounds, 0]


def test_the_former_plan_as_content_is_reported_where_the_render_differs(cohere_tokenizer, monkeypatch):
    """The failure this guards against: with the plan kept as content (as before), the template renders empty plan
    markers, so the one-go render differs from the played tokens at the plan; the loop reports that turn."""
    def plan_as_content(text, *args, **kwargs):
        turn = P.parse_command_r(text)
        if turn.reasoning is not None:
            turn.content, turn.reasoning = f"<|START_THINKING|>{turn.reasoning}<|END_THINKING|>{turn.content}", None
        return turn
    monkeypatch.setattr(ToolFormat, "parser_for", lambda self, tools=None: plan_as_content)
    traj = play(cohere_tokenizer, [action(0, 1, 0, PLANS[0]), ANSWER])
    played, one_go = played_and_one_go(cohere_tokenizer, traj)
    assert played != one_go
    assert traj.metrics["template_rerender_diffs"] == 1
    diff = traj.metrics["template_rerender_first"]
    assert diff["turn"] == 0 and diff["char"] == len("<|START_THINKING|>")
    assert diff["rendered"].startswith("<|START_THINKING|><|END_THINKING|>")


def test_a_call_without_plan_markers_cannot_be_rendered_as_sampled_and_is_reported(cohere_tokenizer):
    """The template writes ``<|START_THINKING|>...<|END_THINKING|>`` before every call, even for a skipped plan,
    which its system prompt allows: a call sampled without them has no message that renders as sampled. Not
    a template fault (observations stay exact; the same template is exact when the model writes the markers), so
    it is not refused up front: the turn is reported where the render differs."""
    traj = play(cohere_tokenizer, [action(0, 1, 0, None), ANSWER])
    assert traj.finish_reason == "stop" and traj.metrics["template_exact"]  # every observation extends the render
    played, one_go = played_and_one_go(cohere_tokenizer, traj)
    assert played != one_go
    diff = traj.metrics["template_rerender_first"]
    assert traj.metrics["template_rerender_diffs"] == 1 and diff["turn"] == 0
    assert diff["char"] == len("<|START_")  # <|START_ACTION|> sampled where the render has <|START_THINKING|>
    assert diff["sampled"].startswith("<|START_ACTION|>") and diff["rendered"].startswith("<|START_THINKING|><|END_THINKING|>")


@pytest.mark.parametrize("text, reasoning, content, calls", [
    ('<|START_THINKING|>\n plan \n<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": "echo", '
     '"parameters": {"text": "a"}}]<|END_ACTION|>', "\n plan \n", "", 1),
    ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "echo", "parameters": {}}]<|END_ACTION|>', None, "", 1),
    ("<|START_THINKING|>all done<|END_THINKING|><|START_RESPONSE|>five<|END_RESPONSE|>", "all done", "five", 0),
    ("<|START_RESPONSE|>five<|END_RESPONSE|>", None, "five", 0),
    ('Sure.\nAction: ```json\n[{"tool_name": "echo", "parameters": {"text": "a"}}]\n```', None, "Sure.", 1),
])
def test_command_r_parser_keeps_the_plan_exactly_as_reasoning(text, reasoning, content, calls):
    turn = P.parse_command_r(text)
    assert (turn.reasoning, turn.content, len(turn.calls), turn.errors) == (reasoning, content, calls, [])


def test_a_turn_the_parser_strips_is_reported_for_hermes_too(qwen_tokenizer):
    """The report is the loop's, not Command R's: a Qwen answer sampled with leading spaces, which the recorded
    (stripped) content renders without, is reported; the same answer sampled plainly is not."""
    def run(answer):
        call = '<tool_call>\n{"name": "echo", "arguments": {"text": "x"}}\n</tool_call><|im_end|>'
        def script(prompt_ids):
            turn = qwen_tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
            return qwen_tokenizer.encode([call, answer][min(turn, 1)])
        return asyncio.run(run_episode(EchoTask(), 0, ScriptedBackend(script), qwen_tokenizer, LoopConfig()))
    plain, spaced = run("done<|im_end|>"), run("  done<|im_end|>")
    assert plain.metrics["template_rerender_diffs"] == 0 and plain.metrics["template_exact"]
    assert spaced.metrics["template_rerender_diffs"] == 1
    assert spaced.metrics["template_rerender_first"] == {"turn": 1, "char": 0, "sampled": "  done", "rendered": "done"}


class SystemEchoTask(EchoTask):
    def make_episode(self, index, seed=0):
        episode = super().make_episode(index, seed)
        episode.messages = [{"role": "system", "content": "Answer briefly."}, *episode.messages]
        return episode


def test_a_parallel_round_after_a_planned_call_is_exact_and_a_fixed_prefix_is_refused(cohere_tokenizer):
    """Issue 49 item 5, the reported conversation: a system message, a planned turn with one call, a turn of two
    parallel calls, a final answer. The template numbers results over every call of the chat, so turn 2's
    results are "1" and "2": the loop, which renders the episode's own messages, plays exactly the one-go render;
    an observation rendered after a fixed one-round prefix (``observation_ids``) would say "0" and "1" there,
    and the analysis now finds that (``history_dependence``) and ``observation_ids`` refuses, naming it (before:
    no finding, and the wrong ids returned)."""
    tok = cohere_tokenizer
    replies = [action(0, 1, 0, "I'll check Paris first."), action(1, 2, 1, ""), ANSWER]

    def script(prompt_ids):
        return tok.encode(replies[min(tok.decode(prompt_ids).count(GENERATION_PROMPT) - 1, 2)], add_special_tokens=False)
    traj = asyncio.run(run_episode(SystemEchoTask(), 0, ScriptedBackend(script), tok, LoopConfig(max_turns=3)))
    assert traj.finish_reason == "stop" and traj.reward == 1.0 and traj.metrics["template_exact"]
    assert traj.metrics["template_rerender_diffs"] == 0
    played, one_go = played_and_one_go(tok, traj)
    assert played == one_go
    before_turn_3 = tok.decode([i for i, s, t in zip(traj.response_ids, traj.spans, traj.turn_ids) if s == 2 and t == 1],
                               skip_special_tokens=False)
    assert re.findall(r'"tool_call_id": "(\d+)"', before_turn_3) == ["1", "2"]
    assert [r.call_id for r in traj.tool_calls] == ["call00000", "call00001", "call00002"]  # unique in the episode

    results = [m for m in traj.messages if m["role"] == "tool"][1:]  # turn 2's two results
    formatter = ChatFormatter(tok, tools=ToolExecutor([echo]).schemas)
    why = formatter.history_dependence(results)
    assert why is not None and "depends on the conversation before it" in why and '"tool_call_id": "' in why
    with pytest.raises(TemplateError, match="numbered over every call of the chat.*cannot give them"):
        formatter.observation_ids(results)
    qwen = ChatFormatter(AutoTokenizer.from_pretrained(qwen_tokenizer_dir()), tools=ToolExecutor([echo]).schemas)
    assert qwen.history_dependence(results) is None and qwen.observation_ids(results)  # a template without such state


def restarting_ids_chat(ids: list[str]) -> tuple[list[dict], list[dict]]:
    """The reported conversation up to turn 2's results, its calls carrying ``ids`` (turn 1's, then turn 2's two)."""
    def call(i, text):
        return {"id": i, "type": "function", "function": {"name": "echo", "arguments": {"text": text}}}
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Echo twice."},
               {"role": "assistant", "content": "", "reasoning_content": "I'll check Paris first.",
                "tool_calls": [call(ids[0], "Paris")]},
               {"role": "tool", "name": "echo", "tool_call_id": ids[0], "content": "Paris"},
               {"role": "assistant", "content": "", "reasoning_content": "",
                "tool_calls": [call(ids[1], "Rome"), call(ids[2], "Oslo")]}]
    return history, [{"role": "tool", "name": "echo", "tool_call_id": i, "content": t} for i, t in zip(ids[1:], "RO")]


def test_call_ids_restarting_per_turn_are_refused_where_the_template_looks_results_up_by_id(cohere_tokenizer):
    """Issue 49 item 5, ids restarting per turn: turn 2's first result has turn 1's call id, and the template finds
    a result's call by its id over the whole chat, so it would number it "0" (turn 1's call) where the call is
    "1": the observation is refused naming the reused id (before: rendered so, silently). Ids unique in the
    conversation (as the loop makes them) observe fine, and a template that does not look ids up (Qwen) takes
    restarting ids as they are."""
    formatter = ChatFormatter(cohere_tokenizer, tools=ToolExecutor([echo]).schemas)
    history, results = restarting_ids_chat(["call00000", "call00000", "call00001"])
    seen = formatter.render_text(history[:-1], add_generation_prompt=True)
    wrong = formatter.render_text(history + results, add_generation_prompt=True)
    assert re.findall(r'"tool_call_id": "(\d+)"', wrong[len(seen):]) == ["1", "2", "0", "2"]  # what it would show
    with pytest.raises(TemplateError, match=r"\['call00000'\] of the last turn are also ids of calls in earlier "
                                            r"messages \[2\].*find.*by its id over the whole chat"):
        formatter.observation(history, seen, results, stop_id=formatter.end_of_turn_ids[0])
    history, results = restarting_ids_chat(["call00000", "call00001", "call00002"])
    observed = formatter.observation(history, seen, results, stop_id=formatter.end_of_turn_ids[0])
    assert observed.mismatch is None
    assert re.findall(r'"tool_call_id": "(\d+)"', cohere_tokenizer.decode(observed.ids)) == ["1", "2"]
    qwen = ChatFormatter(AutoTokenizer.from_pretrained(qwen_tokenizer_dir()), tools=ToolExecutor([echo]).schemas)
    history, results = restarting_ids_chat(["call00000", "call00000", "call00001"])
    seen = qwen.render_text(history[:-1], add_generation_prompt=True)
    assert qwen.observation(history, seen, results, stop_id=qwen.end_of_turn_ids[0]).mismatch is None
