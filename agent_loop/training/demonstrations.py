"""A task's demonstrations (``Task.demonstrate``), played through the agent loop and checked, ready to fine-tune on
(``agent_loop.recipes.warmstart``; docs/design.md section 8a).

Each demonstration is played through the agent loop itself (:func:`replay`): a backend (:class:`ReplayBackend`)
"samples" the demonstration's assistant turns, each the chat template's text of that assistant message after its
generation prompt (the end-of-turn token last), so prompt ids, response ids, spans, tool calls and observations
are exactly those the loop records for a model that wrote those turns (token-in, token-out: docs/design.md
section 4). The tools run; the task scores the episode. A demonstration whose replay differs from it, calls a
tool that fails, or does not succeed is refused (:class:`DemonstrationError`, one line naming the episode).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field

from agent_loop.backends.base import Backend, GenerationResult, SamplingParams
from agent_loop.episode.chat import ChatFormatter, assistant_message
from agent_loop.episode.contracts import Task, as_task, episode_rng
from agent_loop.episode.loop import formatter_for, model_limits
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.episode.parsers import ParsedCall
from agent_loop.episode.tools import ToolExecutor, tool_messages
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.rewards import final_answer
from agent_loop.types import Episode, Trajectory, episode_session_id


class DemonstrationError(ValueError):
    """A task's demonstrations cannot be trained on (the message names the episode and why)."""


def has_demonstrations(task) -> bool:
    """Whether ``task`` writes :meth:`Task.demonstrate` (the default has none)."""
    task = as_task(task)
    return "demonstrate" in vars(task) or type(task).demonstrate is not Task.demonstrate


# --- a demonstration as the loop's messages and the tokens of its assistant turns ---------------------


def _tool_calls(message: dict, where: str) -> list[tuple[str, dict]]:
    """``(name, arguments)`` of an assistant message's ``tool_calls`` (flat or OpenAI-shaped; arguments a dict
    or its JSON text)."""
    calls = []
    for raw in message.get("tool_calls") or []:
        call = raw.get("function", raw) if isinstance(raw, dict) else {}
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise DemonstrationError(f"{where}: a tool call must be {{'name': str, 'arguments': dict}}, got {raw!r}")
        calls.append((name, arguments))
    return calls


def parse_demonstration(messages, prompt: list[dict]) -> list[dict]:
    """The demonstration's turns after ``prompt``, checked: ``{"role": "assistant", "content", "calls"}`` and
    ``{"role": "tool", "content"}`` dicts; the last an assistant turn without calls. DemonstrationError if not."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DemonstrationError(f"must be a non-empty list of messages, got {type(messages).__name__}")
    messages = list(messages)
    if len(messages) > len(prompt) and all(isinstance(m, dict) and (m.get("role"), m.get("content")) ==
                                           (p["role"], p["content"]) for m, p in zip(messages, prompt)):
        messages = messages[len(prompt):]  # a whole chat, such as a Trajectory's messages
    turns = []
    for i, message in enumerate(messages):
        where = f"message {i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("assistant", "tool") or not isinstance(message.get("content") or "", str):
            raise DemonstrationError(f"{where}: expected an assistant or tool message with text content, got {message!r}")
        if role == "tool" and (not turns or not (turns[-1].get("calls") or turns[-1]["role"] == "tool")):
            raise DemonstrationError(f"{where}: a tool result must follow an assistant turn that calls a tool")
        if turns and turns[-1]["role"] == "assistant" and not turns[-1]["calls"]:
            raise DemonstrationError(f"{where}: follows a final answer (an assistant turn without tool calls ends "
                                     "the episode)")
        content = message.get("content") or ""  # an assistant's stripped, as the loop's parser records it
        turns.append({"role": role, "content": content} if role == "tool" else
                     {"role": role, "content": content.strip(), "calls": _tool_calls(message, where)})
    if turns[-1]["role"] != "assistant" or turns[-1]["calls"]:
        raise DemonstrationError("must end with a final answer: an assistant message without tool calls")
    return turns


async def loop_messages(turns: list[dict], toolbox: ToolExecutor, formatter: ChatFormatter) -> list[dict]:
    """``turns`` (:func:`parse_demonstration`) as the loop records them: call ids as the loop makes them, and the
    tool results the demonstration leaves out from running its tools."""
    messages, made, turn = [], 0, 0
    for i, item in enumerate(turns):
        if item["role"] == "tool":
            continue
        ids = [formatter.call_id(name, made + k) for k, (name, _) in enumerate(item["calls"])]
        made += len(ids)
        messages.append(assistant_message(item["content"], [
            {"name": name, "arguments": arguments, "id": call_id} for (name, arguments), call_id in zip(item["calls"], ids)]
            or None))
        given = [t["content"] for t in itertools.takewhile(lambda t: t["role"] == "tool", turns[i + 1:])]
        if ids and not given:
            records = await toolbox.execute([ParsedCall(n, a) for n, a in item["calls"]], turn=turn)
            for record, call_id in zip(records, ids):
                record.call_id = call_id
            given = [m["content"] for m in tool_messages(records)]
        if len(given) != len(ids):
            raise DemonstrationError(f"assistant turn {turn} makes {len(ids)} tool calls but {len(given)} tool results "
                                     "follow it (give all of them or none)")
        messages += [{"role": "tool", "name": name, "tool_call_id": call_id, "content": content}
                     for (name, _), call_id, content in zip(item["calls"], ids, given)]
        turn += 1
    return messages


def assistant_turn_ids(formatter: ChatFormatter, history: list[dict], message: dict) -> list[int]:
    """The ids a model writes for ``message`` after ``history``'s generation prompt: the chat template's text of
    the turn, encoded, then the end-of-turn token that closes it (docs/design.md section 4)."""
    seen = formatter.render_text(history, add_generation_prompt=True)
    full = formatter.render_text(history + [message])
    if not full.startswith(seen):
        raise DemonstrationError("the chat template does not render this assistant turn after its generation prompt")
    rest = full[len(seen):]
    stops = [(rest.find(text), token) for token in formatter.end_of_turn_ids
             if (text := formatter.tokenizer.decode([token])) and text in rest]
    if not stops:
        raise DemonstrationError(f"no end-of-turn token closes the assistant turn {rest[:200]!r}")
    end, token = min(stops)
    return formatter.encode(rest[:end]) + [token]


@dataclass
class Demonstration:
    """One demonstration, ready to replay: its episode's index and prompt, the loop's messages after it, and
    the ids of each assistant turn."""

    index: int
    prompt: list[dict]
    messages: list[dict]
    turns: list[list[int]] = field(default_factory=list)


async def prepare(task: Task, index: int, seed: int, tokenizer) -> Demonstration | None:
    """Episode ``index``'s demonstration (None when the task gives none for it); DemonstrationError if unusable."""
    episode: Episode = task.make_episode(index, seed)
    try:
        raw = task.demonstrate(episode, episode_rng(f"{task.name}:demonstrate", seed, index))
    except Exception as error:
        raise DemonstrationError(f"episode {index}: demonstrate raised {type(error).__name__}: {error}") from None
    if raw is None:
        return None
    toolbox = ToolExecutor(episode.tools)
    formatter = formatter_for(tokenizer, toolbox.schemas)
    try:
        messages = await loop_messages(parse_demonstration(raw, episode.messages), toolbox, formatter)
        turns = [assistant_turn_ids(formatter, episode.messages + messages[:i], m)
                 for i, m in enumerate(messages) if m["role"] == "assistant"]
    except DemonstrationError as error:
        raise DemonstrationError(f"episode {index}: the demonstration {error}") from None
    return Demonstration(index, list(episode.messages), messages, turns)


class ReplayBackend(Backend):
    """Answers an episode's k-th request with its demonstration's k-th assistant turn (ids fixed in advance,
    logprob 0): the agent loop plays the demonstration as if a model had written it. ``turns`` is keyed by the
    loop's session id of each episode (``agent_loop.types.episode_session_id``, the loop's own)."""

    retries_itself = True  # a replay that fails does not get better by asking again

    def __init__(self, turns: dict[str, list[list[int]]]):
        self.turns, self.played = turns, Counter()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None) -> GenerationResult:
        turn = self.played[session_id]
        self.played[session_id] += 1
        ids = list(self.turns[session_id][turn])
        return GenerationResult(ids, [0.0] * len(ids), "stop")


def _difference(recorded: list[dict], expected: list[dict]) -> str | None:
    """Where the loop's record of a replayed demonstration differs from the demonstration, or None."""
    for i, (got, want) in enumerate(zip(recorded, expected)):
        if got != want:
            return f"message {i} replays as {got!r}, not as demonstrated {want!r}"
    if len(recorded) != len(expected):
        return f"replays as {len(recorded)} messages, not the {len(expected)} demonstrated"
    return None


def check_replay(trajectory: Trajectory, demonstration: Demonstration) -> str | None:
    """Why a replayed demonstration cannot be trained on, or None: it ended otherwise than with its final answer,
    the loop recorded other messages, a tool call failed, the template was not exact, or it does not succeed."""
    if trajectory.finish_reason != "stop":
        why = (trajectory.metrics.get("backend_error") or trajectory.metrics.get("error")
               or trajectory.info.get("reward_error") or "")
        return f"ends with finish {trajectory.finish_reason!r} {why}".strip()
    if (diff := _difference(trajectory.messages[len(demonstration.prompt):], demonstration.messages)) is not None:
        return diff
    failed = next((c for c in trajectory.tool_calls if c.error_kind), None)
    if failed is not None:
        return f"its tool call {failed.name}({failed.arguments}) fails: {failed.error}"
    if not trajectory.metrics.get("template_exact", True):
        return f"the chat template renders it otherwise than turn by turn: {trajectory.metrics.get('template_first_diff')}"
    if not trajectory.success:
        return (f"does not succeed (reward {trajectory.reward:g}; final answer "
                f"{final_answer(trajectory.messages)!r})")
    return None


async def _prepare_all(task: Task, tokenizer, episodes: range, seed: int) -> tuple[list[Demonstration], int]:
    """The demonstrations of ``episodes`` (:func:`prepare`) and how many of them the task gave none for."""
    demonstrations = [await prepare(task, index, seed, tokenizer) for index in episodes]
    return [d for d in demonstrations if d is not None], sum(d is None for d in demonstrations)


def replay(task, tokenizer, episodes: range, seed: int = 0, *, output_path=None, progress: bool = True) -> list[Trajectory]:
    """The demonstrations of ``task``'s episodes ``episodes`` (under ``seed``), played through the agent loop and
    checked (:func:`check_replay`); with ``output_path``, also written there as JSON Lines. DemonstrationError
    (one line: how many, the first and why) if the task gives none or any is unusable."""
    task = as_task(task)
    if not has_demonstrations(task):
        raise DemonstrationError(f"task {task.name!r} has no demonstrations: give it a demonstrate(episode, rng) "
                                 "method returning a solved episode's messages (examples/custom_task.py)")
    demonstrations, missing = asyncio.run(_prepare_all(task, tokenizer, episodes, seed))
    if not demonstrations:
        raise DemonstrationError(f"task {task.name!r} gave no demonstration for its episodes {episodes.start}.."
                                 f"{episodes.stop - 1} (demonstrate returned None for each)")
    context = model_limits(tokenizer)[1] or 1 << 20
    config = LoopConfig(max_turns=max(len(d.turns) for d in demonstrations), backend_retries=0,
                        max_tokens=max(len(ids) for d in demonstrations for ids in d.turns),
                        max_response_tokens=context, max_observation_tokens=context, on_template_mismatch="error")
    backend = ReplayBackend({episode_session_id(task.name, seed, d.index): d.turns for d in demonstrations})
    trajectories = asyncio.run(run_rollouts(task, backend, tokenizer, [d.index for d in demonstrations], config, seed,
                                            output_path=output_path, progress=progress))
    problems = [(d.index, why) for d, t in zip(demonstrations, trajectories) if (why := check_replay(t, d))]
    if problems:
        where = f" (all are in {output_path}: agent-loop inspect shows them)" if output_path else ""
        raise DemonstrationError(f"{len(problems)} of {len(demonstrations)} demonstrations cannot be trained on; "
                                 f"the first, episode {problems[0][0]}: {problems[0][1]}{where}")
    if missing:
        warnings.warn(f"demonstrate gave none for {missing} of {len(episodes)} episodes; training on the other "
                      f"{len(demonstrations)}", stacklevel=2)
    return trajectories
