"""Warm start: fine-tune a model on a task's demonstrations (``Task.demonstrate``), loss on ASSISTANT tokens only,
so that RL on one's own task starts from a model that calls its tools (docs/design.md section 8a).

1. **Demonstrations, as the loop records them.** Each one is played through the agent loop itself
   (:func:`replay`): a backend "samples" the demonstration's assistant turns, each the chat template's text
   of that assistant message after its generation prompt (the end-of-turn token last), so prompt ids,
   response ids, spans, tool calls and observations are exactly those the loop records for a model that
   wrote those turns (token-in, token-out: docs/design.md section 4). The tools run; the task scores the
   episode. A demonstration whose replay differs from it, calls a tool that fails, or does not succeed is
   refused (:class:`DemonstrationError`, one line naming the episode).
2. **The fine-tune** (:func:`fine_tune`): the replayed trajectories are collated (``trajectories_to_batch``),
   and each step takes the mean next-token cross-entropy over the ASSISTANT tokens (``spans == ASSISTANT``,
   the loop's response mask; the end-of-turn token included) of ``batch_size`` demonstrations, in
   micro-batches through the trainer's own forward (``agent_loop.training.policy``: the shared prompt prefix once), with
   AdamW, linear warm-up and cosine decay (to a tenth of the peak; ``agent_loop.training.optimization``, as ``train``),
   gradient clipping; checkpoints and the run's folder as ``train``'s (``agent_loop.training.checkpoint``).
3. **Outputs** (:func:`warm_start`): ``OUTPUT_DIR/model`` (a model folder ``agent-loop rollout --model`` and
   ``agent-loop train --model`` load, written as a checkpoint is: atomically, with a manifest), ``metrics.jsonl`` (loss, learning rate and gradient norm per step) and
   ``demonstrations.jsonl`` (the replayed episodes: ``agent-loop inspect`` shows what was trained on).
4. **The check** (:func:`held_out_check`, ``--check-episodes``, 0 skips it): the saved model plays held-out
   questions (train's evaluation stream), sampled at T=1, into ``check.jsonl``; the CLI prints their success
   (:func:`check_line`), so a warm start that did not take shows before RL starts from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import agent_loop.training.checkpoint as checkpoint
import agent_loop.training.optimization as optimization
from agent_loop.backends.base import Backend, GenerationResult, SamplingParams
from agent_loop.episode.chat import ChatFormatter
from agent_loop.episode.config import LoopConfig
from agent_loop.episode.loop import formatter_for, model_limits
from agent_loop.episode.parsers import ParsedCall
from agent_loop.episode.tools import ToolExecutor, tool_messages
from agent_loop.models import model_path
from agent_loop.recipes.warmstart_options import MIN_LR_FRACTION, WarmstartConfig
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.base import Task, as_task, episode_rng
from agent_loop.tasks.rewards import final_answer
from agent_loop.threads import apply_threads
from agent_loop.training.distributed import resolve_device
from agent_loop.training.metrics import MetricsLogger
from agent_loop.training.policy import PolicyModel, micro_batches, policy_outputs
from agent_loop.types import Episode, Trajectory, episode_session_id
from masking.batch import Batch
from masking.kinds import SpanKind

TINY_STAGE = "final"  # unset --model: the fully trained tiny agent (the one that calls tools best)
DEMONSTRATIONS_FILE, METRICS_FILE, MODEL_DIR = "demonstrations.jsonl", "metrics.jsonl", "model"
CHECK_FILE = "check.jsonl"  # the held-out check's episodes (--check-episodes), sampled at T=1
CHECK_TEMPERATURE = 1.0  # as train samples its rollouts: what RL will start from
CHECKPOINTS_DIR = "checkpoints"  # OUTPUT_DIR/checkpoints/step_NNNNNN, the latest only (--save-every, --resume)


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
        messages.append(formatter.assistant_message(item["content"], [
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


# --- the fine-tune ---------------------------------------------------------------------------------


def assistant_mask(batch: Batch) -> torch.Tensor:
    """``(b, t)`` bool: the ASSISTANT tokens (``Batch.response_mask``), every one of which a warm start trains on
    (no rollout correction here: nothing like ``Batch.loss_mask`` leaves any out)."""
    return batch.spans == SpanKind.ASSISTANT


def summed_loss(model: PolicyModel, micro: Batch) -> torch.Tensor:
    """The summed next-token cross-entropy of ``micro``'s ASSISTANT tokens (each predicted from every token
    before it, prompt included), a 0-dim tensor with gradient."""
    logprobs, _, _ = policy_outputs(model, micro, entropy=False)
    return -torch.where(assistant_mask(micro), logprobs, 0.0).sum()


def step_loss(model: PolicyModel, batch: Batch, rows: torch.Tensor, micro_batch_size: int, *,
              backward: bool = True) -> torch.Tensor:
    """The mean cross-entropy over the ASSISTANT tokens of ``batch``'s rows ``rows`` (every token weighs the
    same), run in micro-batches; with ``backward``, each micro-batch's share of its gradient is accumulated."""
    tokens = assistant_mask(batch)[rows].sum().clamp(min=1)
    total = torch.zeros((), device=batch.responses.device)
    for _, micro in micro_batches(batch, rows, micro_batch_size):
        loss = summed_loss(model, micro) / tokens
        if backward:
            loss.backward()
        total += loss.detach()
    return total


def demonstration_order(n: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """``(steps, batch_size)`` row numbers: passes over ``n`` demonstrations, each pass in a new random order."""
    generator = torch.Generator().manual_seed(seed)
    passes = -(-steps * batch_size // n)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(passes)])
    return order[: steps * batch_size].view(steps, batch_size)


def planned_steps(config: WarmstartConfig, demonstrations: int) -> int:
    """``config.steps``, or when unset ``ceil(passes x demonstrations / batch_size)`` (``WarmstartConfig.passes``:
    ``--epochs``, or the model's default): the work scales with the data."""
    return config.steps or max(1, math.ceil(config.passes * demonstrations / config.batch_size))


def work_line(demonstrations: list[Trajectory], config: WarmstartConfig) -> str:
    """The work ahead, printed before it starts: demonstrations, their tokens, steps and passes."""
    n = len(demonstrations)
    prompt, response = (sum(map(len, (getattr(t, name) for t in demonstrations))) / n
                        for name in ("prompt_ids", "response_ids"))
    seen = config.steps * config.batch_size
    return (f"warm start: {n} demonstrations of {prompt:.0f} prompt + {response:.0f} response tokens on average; "
            f"{config.steps} steps x {config.batch_size} = {seen} demonstrations ({seen / n:.3g} passes), about "
            f"{seen * (prompt + response):,.0f} tokens through the model")


def eta_line(seconds: float, done: int, steps: int) -> str:
    """The estimate after the first step of this process: how long the rest will take at that pace."""
    left = (steps - done) * seconds
    return (f"warm start: step {done} took {seconds:.1f} s; ETA {left / 60:.1f} min for the other {steps - done} steps "
            "(--steps or --epochs change them; checkpoints every --save-every steps, --resume goes on)")


def lr_at(step: int, config: WarmstartConfig) -> float:
    """The learning rate of 0-based ``step``: linear warm-up from 0, then a cosine down to ``MIN_LR_FRACTION`` of
    the peak (``agent_loop.training.optimization.lr_at``, the schedule the warm start has always used)."""
    return optimization.lr_at(step, peak=config.learning_rate, warmup_steps=config.warmup_steps, warmup_start=0,
                              decay_steps=config.steps, min_fraction=MIN_LR_FRACTION)


def fine_tune(model, batch: Batch, config: WarmstartConfig, logger: MetricsLogger | None = None, *,
              save=None, state: dict | None = None) -> list[dict]:
    """Train ``model`` (a causal LM, on ``batch``'s device) for ``config.steps`` steps on ``batch``'s demonstrations
    (:func:`step_loss`); the metrics of every step run here (``loss``, ``lr``, ``grad_norm``, ``tokens``), also
    logged. ``save(step, state)`` is called every ``config.save_every`` steps with the optimizer and RNG states;
    ``state`` (one of those) goes on from its step as if never stopped (the learning rate is :func:`lr_at` of the
    step: an older checkpoint's ``schedule`` state is not needed)."""
    policy = PolicyModel(model).train()
    optimizer = optimization.adamw(model.parameters(), config)
    first = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        checkpoint.set_rng_state(state["rng"])
        first = state["step"]
    order = demonstration_order(batch.responses.shape[0], config.steps, config.batch_size, config.seed)
    history = []
    bar = tqdm(range(first, config.steps), desc="warm start", unit="step", disable=not config.progress)
    for step in bar:
        started = time.perf_counter()
        optimization.set_lr(optimizer, lr_at(step, config))
        metrics = _step(policy, optimizer, batch, order[step].to(batch.responses.device), config)
        history.append(metrics)
        if logger is not None:
            logger.log(step + 1, metrics)
        if step == first and step + 1 < config.steps:
            tqdm.write(eta_line(time.perf_counter() - started, step + 1, config.steps))
        if save is not None and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
            save(step + 1, {"step": step + 1, "optimizer": optimizer.state_dict(), "rng": checkpoint.rng_state()})
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)  # this step's: shown as the bar next moves
    model.eval()
    return history


def _step(policy, optimizer, batch: Batch, rows: torch.Tensor, config: WarmstartConfig) -> dict:
    """One optimizer step on ``rows`` (at the learning rate set on ``optimizer``); its metrics."""
    lr = optimizer.param_groups[0]["lr"]
    loss = step_loss(policy, batch, rows, config.micro_batch_size)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = float(assistant_mask(batch)[rows].sum())
    return {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(), "tokens": tokens}


def model_filler(model, tokenizer):
    """What fills a model folder: ``model`` and ``tokenizer`` (its chat template too), saved into the folder given."""
    def fill(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return fill


def save_model(model, tokenizer, folder: Path, *, step: int) -> Path:
    """``model`` and ``tokenizer`` as model folder ``folder``, written as a checkpoint is
    (``agent_loop.training.checkpoint.write_folder``): beside it first, with a manifest (sizes, sha256, ``step``), fsynced,
    renamed into place; an earlier folder there is swapped out, never emptied first."""
    return checkpoint.write_folder(folder, fill=model_filler(model, tokenizer),
                                   manifest={"format": checkpoint.FORMAT, "step": step})


@dataclass
class WarmstartResult:
    """What a warm start made: the model folder, the metrics per step, the demonstrations it trained on."""

    model_dir: Path
    history: list[dict]
    demonstrations: list[Trajectory]
    seconds: float
    check: list[Trajectory] = field(default_factory=list)  # the held-out check's episodes (:func:`held_out_check`)

    @property
    def longest(self) -> dict[str, int]:
        """The largest budgets a demonstration needs: ``turns``, ``response_tokens`` and ``turn_tokens``."""
        turns = [t.metrics["turn_tokens"] for t in self.demonstrations]
        return {"turns": max(len(t) for t in turns), "response_tokens": max(len(t.response_ids) for t in self.demonstrations),
                "turn_tokens": max(turn["assistant"] for t in turns for turn in t)}


def warm_start(config: WarmstartConfig, task=None) -> WarmstartResult:
    """Replay the task's demonstrations, fine-tune the model on them, save it (see the module docstring).

    ``task``: any task object; default: the one ``config`` names. ``config.output_dir`` must hold no earlier
    warm start (FileExistsError; the CLI checks and locks it first), unless ``config.resume``: then it goes on
    from the latest complete checkpoint there (CheckpointError if none, or if the settings differ)."""
    from agent_loop.config import checked

    started = time.perf_counter()
    config = checked(config)
    task = task if task is not None else config.load()
    apply_threads(config.threads)  # the one threads rule (agent_loop.threads)
    torch.manual_seed(config.seed)
    output = Path(config.output_dir)
    resume = checkpoint.resolve_checkpoint(output / CHECKPOINTS_DIR) if config.resume else None
    earlier = [name for name in (DEMONSTRATIONS_FILE, METRICS_FILE, MODEL_DIR) if (output / name).exists()]
    if earlier and resume is None:
        raise FileExistsError(f"{output} holds an earlier warm start ({', '.join(earlier)}); give another output_dir "
                              "or empty it")
    output.mkdir(parents=True, exist_ok=True)
    source = model_path(config.model, TINY_STAGE)
    tokenizer = AutoTokenizer.from_pretrained(source)
    demonstrations = replay(task, tokenizer, range(config.episodes), config.seed, progress=config.progress,
                            output_path=None if resume else output / DEMONSTRATIONS_FILE)
    config = dataclasses.replace(config, steps=planned_steps(config, len(demonstrations)))
    device = resolve_device(config.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = trajectories_to_batch(demonstrations, pad_token_id=pad).to(device)
    state = _resumed_state(resume, config, output) if resume else None
    model = AutoModelForCausalLM.from_pretrained(resume / MODEL_DIR if resume else source, dtype=torch.float32).to(device)
    tqdm.write(work_line(demonstrations, config))
    earlier_history = _logged(output / METRICS_FILE) if resume else []
    logger = MetricsLogger(output, fresh=resume is None, tensorboard=False)
    try:
        history = fine_tune(model, batch, config, logger, state=state,
                            save=lambda step, state: _save(output, step, state, model, tokenizer, config, source))
    finally:
        logger.close()
    if not all(math.isfinite(m["loss"]) for m in history):
        raise FloatingPointError(f"the loss is not finite (see {logger.path}); nothing saved; lower --lr")
    folder = save_model(model, tokenizer, output / MODEL_DIR, step=config.steps)
    result = WarmstartResult(folder, earlier_history + history, demonstrations, time.perf_counter() - started)
    if config.check_episodes:
        result.check = held_out_check(model, tokenizer, task, config, result.longest, output / CHECK_FILE)
    return result


def check_loop_config(longest: dict[str, int]) -> LoopConfig:
    """The held-out check's loop options: ``rollout``'s defaults, sampled at :data:`CHECK_TEMPERATURE`, with
    budgets raised to what the longest demonstration needs (``WarmstartResult.longest``), so that the check
    measures the model, not a budget (the CLI's report names a default budget that is too small)."""
    default = LoopConfig()
    return dataclasses.replace(default, temperature=CHECK_TEMPERATURE, max_turns=max(default.max_turns, longest["turns"]),
                               max_response_tokens=max(default.max_response_tokens, longest["response_tokens"]),
                               max_tokens=max(default.max_tokens, longest["turn_tokens"]))


def held_out_check(model, tokenizer, task, config: WarmstartConfig, longest: dict[str, int], path: Path) -> list[Trajectory]:
    """``config.check_episodes`` held-out questions of ``task`` (episodes 0.. under ``config.seed`` plus train's
    ``EVAL_SEED_OFFSET``: never the demonstrations' questions), played by the fine-tuned ``model`` in this
    process (the transformers backend, on its device), sampled (:func:`check_loop_config`), written to ``path``."""
    from agent_loop.backends.hf import TransformersBackend
    from agent_loop.recipes.train import EVAL_SEED_OFFSET

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    Path(path).unlink(missing_ok=True)  # a resumed run's earlier check
    with TransformersBackend(model, device=device, pad_token_id=pad) as backend:
        return asyncio.run(run_rollouts(as_task(task), backend, tokenizer, range(config.check_episodes),
                                        check_loop_config(longest), config.seed + EVAL_SEED_OFFSET,
                                        output_path=path, progress=config.progress))


def check_line(trajectories: list[Trajectory]) -> str:
    """The held-out check as the CLI prints it: success with its sampling and episode count, tool calls and
    tool errors per episode (malformed calls among them); a hint when fewer than half succeed."""
    from agent_loop.config import plural
    from agent_loop.runners.stats import sampling_label
    from agent_loop.training.metrics import rollout_metrics

    metrics, n = rollout_metrics(trajectories), len(trajectories)
    line = (f"held-out check ({sampling_label(CHECK_TEMPERATURE)}, {plural(n, 'episode')}): success "
            f"{metrics['success']:.3f}; {metrics['tool_calls']:.2f} tool calls and "
            f"{metrics['errors/tool'] / n:.2f} tool errors an episode")
    if metrics["success"] < 0.5:
        line += ("; under half: the warm start did not take (a larger --lr or more --steps; agent-loop inspect "
                 "shows the episodes)")
    return line


def _save(output: Path, step: int, state: dict, model, tokenizer, config: WarmstartConfig, source) -> None:
    """A checkpoint of step ``step`` (``agent_loop.training.checkpoint.write_checkpoint``: atomic, with a manifest); the
    earlier ones are removed (each holds a whole model)."""
    root = output / CHECKPOINTS_DIR
    path = checkpoint.write_checkpoint(root / f"step_{step:06d}", step=step, save_model=model_filler(model, tokenizer),
                                       state={**state, "initial_model": str(source), "config": config.resolved()})
    for older in root.glob("step_*"):
        if older != path:
            shutil.rmtree(older, ignore_errors=True)


def _resumed_state(resume: Path, config: WarmstartConfig, output: Path) -> dict:
    """The checkpoint's state, its settings checked against ``config``'s; metrics.jsonl cut back to its step."""
    state = checkpoint.load_state(resume)
    checkpoint.check_settings(state["config"], config)
    checkpoint.trim_metrics(output / METRICS_FILE, state["step"])
    return state


def _logged(path: Path) -> list[dict]:
    """The metrics of the steps ``path`` (metrics.jsonl) holds, without their step numbers."""
    return [{k: v for k, v in json.loads(line).items() if k != "step"}
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
