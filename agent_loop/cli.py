"""``agent-loop`` command line: ``rollout``, ``inspect``, ``train``.

Every option is declared once (:class:`RolloutOptions` here, ``trainer.config.TrainConfig`` for
``train``) and checked before anything starts; a bad value is one line on stderr naming the option,
its value and what is allowed, exit status 2 (docs/errors.md lists the cases).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from rich.console import Console
from rich.table import Table

from agent_loop import options, preflight
from agent_loop.loop import LoopConfig
from agent_loop.options import USAGE_EXIT, UsageError

_LOOP = LoopConfig()
DEFAULT_OUT = "runs/rollouts.jsonl"
RETURNS_SAMPLE = 256  # episodes (the lowest indices) the rollout's returns table is computed on


@dataclass
class RolloutOptions:
    """The options of ``agent-loop rollout`` (and the keys of its config file)."""

    __pydantic_config__ = options.STRICT_NUMBERS

    task: Annotated[str, AfterValidator(options.check_task),
                    Field(description="task to play", json_schema_extra={"allowed": options.task_names})] = "arithmetic"
    model: Annotated[str | None, Field(description="local model folder (config.json, tokenizer, chat template); "
                                       "unset: the built-in tiny agent", json_schema_extra={"allowed": "a folder"})] = None
    backend: Annotated[Literal["hf", "vllm", "http"],
                       Field(description="hf: transformers in-process; vllm: vLLM engine in-process; "
                                         "http: OpenAI-compatible server(s) given by --server")] = "hf"
    server: Annotated[list[Annotated[str, AfterValidator(preflight.check_url)]],
                      Field(description="server root URL for --backend http; repeat for several servers "
                                        "(probed with GET /v1/models at start)",
                            json_schema_extra={"allowed": "an http(s) URL, repeatable"})] = field(default_factory=list)
    episodes: Annotated[int, Field(ge=1, description="episodes to play (indices 0 .. N-1)")] = 64
    out: Annotated[str | None, Field(description="JSON Lines file the episodes are written to as they finish; unset: "
                                     f"{DEFAULT_OUT}, or the first free {DEFAULT_OUT.replace('.jsonl', '-N.jsonl')} "
                                     "when that exists (an existing file is only added to with --resume/--append)",
                                     json_schema_extra={"allowed": "a file path (not a folder)"})] = None
    seed: Annotated[int, Field(ge=0, description="seed of the questions and of each request's sampling")] = 0
    concurrency: Annotated[int, Field(ge=1, description="episodes in flight at once")] = 16
    gamma: Annotated[float, Field(ge=0, le=1, description="discount of the returns in the summary table")] = 1.0
    estimator: Annotated[str, AfterValidator(options.check_row_estimator), Field(
        description="advantage estimator of the summary table (one that needs no group ids or critic values)",
        json_schema_extra={"allowed": options.row_estimator_names})] = "reinforce_plus_plus"
    max_turns: Annotated[int, Field(ge=1, description="assistant turns per episode")] = _LOOP.max_turns
    max_response_tokens: Annotated[int, Field(ge=1, description="assistant + observation tokens per episode")] = \
        _LOOP.max_response_tokens
    max_tokens: Annotated[int, Field(ge=1, description="tokens per assistant turn")] = _LOOP.max_tokens
    max_observation_tokens: Annotated[int, Field(ge=1, description="tokens per tool observation; longer results "
                                                 "are truncated and marked")] = _LOOP.max_observation_tokens
    max_parallel_tool_calls: Annotated[int, Field(ge=1, description="tool calls run at once within a turn")] = \
        _LOOP.max_parallel_tool_calls
    tool_timeout_s: Annotated[float, Field(gt=0, description="seconds a tool call may run before it ends in a "
                                           "timeout error observation")] = _LOOP.tool_timeout_s
    temperature: Annotated[float, Field(ge=0, description="sampling temperature; 0 = greedy")] = _LOOP.temperature
    top_p: Annotated[float, Field(gt=0, le=1, description="nucleus sampling mass; 1 = off")] = _LOOP.top_p
    top_k: Annotated[int, Field(ge=0, description="sample among the k likeliest tokens; 0 = off")] = _LOOP.top_k
    resume: Annotated[bool, Field(description="play only the episodes --out lacks (same seed and task), "
                                  "appending them; a torn last line is repaired first")] = False
    append: Annotated[bool, Field(description="append to an existing --out (without --resume/--append an "
                                  "existing non-empty --out is refused, never emptied)")] = False
    max_error_fraction: Annotated[float, Field(ge=0, le=1, description="exit status 1 when more episodes than "
                                               "this fraction end with an error")] = 0.1
    retry_deadline_s: Annotated[float, Field(gt=0, description="http backend: how long one request retries; "
                                             "all servers down this long stops the run")] = 300.0

    def loop_config(self) -> LoopConfig:
        names = LoopConfig.__dataclass_fields__
        return LoopConfig(**{k: getattr(self, k) for k in names if hasattr(self, k)})


PLUGIN_OPTIONS = ("prompts", "reward", "reward_weights", "tools", "system")  # a task from data (agent_loop.plugins)


def add_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompts/--reward/--reward-weights/--tools/--system: a task from data (agent_loop.plugins)."""
    parser.add_argument("--prompts", default=None, help="prompts file: .jsonl, .parquet or a saved HF dataset folder")
    parser.add_argument("--reward", action="append", default=[],
                        help="reward of --prompts: exact, number, contains, regex:PATTERN or module:function (repeatable)")
    parser.add_argument("--reward-weights", type=float, nargs="+", default=None, help="one weight per --reward")
    parser.add_argument("--tools", default=None, help="tools of --prompts: a module or .py file of functions")
    parser.add_argument("--system", default=None, help="system prompt for --prompts episodes")


def parse_command(parser: argparse.ArgumentParser, argv: list[str], default_task: str, check):
    """Parse ``argv`` (with its ``--config`` file, if any), check the values with ``check(values) -> options``,
    then load the task they name; returns (parsed args, options, task).

    The task comes from ``--task`` (a registered name, ``package.module:Name`` or ``file.py[:Name]``) or from
    ``--prompts`` with ``--reward``/``--tools``; a plug-in that cannot load is a UsageError."""
    from agent_loop.config import parse_with_config
    from agent_loop.plugins import PluginError, task_from_options

    args = parse_with_config(parser, argv)
    values = {k: v for k, v in vars(args).items() if k not in (*PLUGIN_OPTIONS, "config")}
    plugin = {k: getattr(args, k) for k in PLUGIN_OPTIONS}
    given = values.get("task")  # absent: not given on the command line nor in the file
    task_given = given is not None and (given != default_task or any(a.split("=")[0] == "--task" for a in argv))
    checked = check(values)
    try:
        task = task_from_options(given if task_given else None, default_task=default_task, **plugin)
    except PluginError as error:
        raise UsageError(str(error)) from None
    resolved = argparse.Namespace(**{**vars(args), **dataclasses.asdict(checked)})  # checked values, typed
    return resolved, checked, task


def build_parser(prog: str = "agent-loop rollout") -> argparse.ArgumentParser:
    """The parser of ``agent-loop rollout``: one option per field of :class:`RolloutOptions`, plus the
    plug-in options and ``--config``."""
    from agent_loop.config import add_config_argument

    parser = options.build_parser(RolloutOptions, prog, "Play episodes of a task with a model and write them as "
                                  "JSON Lines; print a summary and the batch's returns and advantages (--estimator).")
    add_plugin_arguments(parser)
    add_config_argument(parser)
    return parser


def validate(values: dict, *, keys: bool = False) -> RolloutOptions:
    """Check ``values`` (flags by default; ``keys=True`` for a config file's keys) and the rules that tie
    options together; UsageError (one line) on the first problem. Touches nothing outside."""
    opts = options.validate(RolloutOptions, values, keys=keys)
    if opts.backend == "http" and not opts.server:
        raise UsageError("--backend http: needs at least one --server URL (e.g. --server http://127.0.0.1:8000)")
    if opts.resume and opts.append:
        raise UsageError("--resume and --append exclude each other: --resume appends only the missing episodes")
    if opts.server and opts.backend != "http":
        raise UsageError(f"--server {opts.server[0]}: used by --backend http only (got --backend {opts.backend})")
    if opts.out is None:  # README's command runs again without touching the last run's file
        opts.out = DEFAULT_OUT if opts.resume or opts.append else free_path(DEFAULT_OUT)
    return opts


def free_path(path: str) -> str:
    """``path`` if nothing is there, else the first free ``stem-N.suffix`` beside it (N = 2, 3, ...)."""
    target = Path(path)
    number = 2
    while target.exists():
        target = Path(path).with_name(f"{Path(path).stem}-{number}{Path(path).suffix}")
        number += 1
    return str(target)


def preflight_rollout(opts: RolloutOptions) -> str:
    """Check the model folder, the output path and the servers; return the model path. Reads only."""
    if opts.model is not None:
        preflight.check_model_dir(opts.model, opts.backend)
    preflight.check_output_file(opts.out)
    model_path = resolve_model(opts)
    if opts.backend == "http":
        preflight.probe_servers(opts.server, model=model_path)
    return model_path


def resolve_model(opts) -> str:
    if opts.model:
        return opts.model
    from agent_loop.tiny import tiny_agent_path

    return str(tiny_agent_path())


def make_backend(opts: RolloutOptions, model_path: str):
    """The backend named by ``--backend``, built over ``model_path``."""
    if opts.backend == "hf":
        from agent_loop.backends.hf import TransformersBackend

        return TransformersBackend(model_path)
    if opts.backend == "vllm":
        from agent_loop.backends.vllm_engine import VLLMEngineBackend

        return VLLMEngineBackend(model_path)
    from agent_loop.backends.openai_http import OpenAIHTTPBackend

    return OpenAIHTTPBackend(opts.server, model=model_path, retry_deadline_s=opts.retry_deadline_s)


async def close_backend(backend) -> None:
    """Shut a backend down if it has ``close()`` (the vLLM engine's process, the HTTP connection pool)."""
    close = getattr(backend, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


def summary_table(stats, title: str) -> Table:
    """Success, reward, turns, token counts, finish reasons and tool errors of a run (its RolloutStats)."""
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("episodes", f"{stats.episodes}"),
        ("success rate", f"{stats.success_rate:.3f}"),
        ("mean reward", f"{stats.mean('reward_sum'):.3f}"),
        ("mean turns", f"{stats.mean('turns'):.2f}"),
        ("assistant tokens / episode", f"{stats.mean('assistant_tokens'):.1f}"),
        ("observation tokens / episode", f"{stats.mean('observation_tokens'):.1f}"),
        ("tool calls / episode", f"{stats.mean('tool_calls'):.2f}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in stats.finish_reasons.most_common())),
        ("tool errors", ", ".join(f"{k} {v}" for k, v in stats.tool_errors.most_common()) or "none"),
        ("template mismatch / drift episodes", f"{stats.template_mismatches} / {stats.template_drifts}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def failure_summary(stats) -> str | None:
    """Why a run has nothing to summarize (every episode errored, or no assistant token was sampled), from the
    episodes' own records; None when there is something to summarize."""
    errors = stats.finish_reasons.get("error", 0)
    if stats.episodes and errors == stats.episodes:
        first = "; ".join(f"episode {i}: {message}" for i, message in stats.first_errors)
        return f"every episode ({errors}) ended in a backend error; first: {first}"
    if stats.assistant_tokens < 2:
        return (f"the {stats.episodes} episodes sampled {stats.assistant_tokens} assistant tokens in all "
                f"(finish reasons: {dict(stats.finish_reasons)}); nothing to compute returns on")
    return None


def returns_table(trajectories, pad_token_id: int, gamma: float, estimator: str = "reinforce_plus_plus") -> Table:
    """Collate the batch and show what the registered ``estimator`` gives the assistant tokens."""
    from advantages import get_estimator
    from agent_loop.collate import trajectories_to_batch

    batch = trajectories_to_batch(trajectories, pad_token_id=pad_token_id)
    adv, returns = get_estimator(estimator)(batch.token_level_rewards, batch.response_mask, gamma=gamma, spans=batch.spans)
    mask = batch.response_mask.bool()
    table = Table(title=f"batch tensors and {estimator} (gamma={gamma}), "
                        f"episodes {trajectories[0].info['index']}-{trajectories[-1].info['index']}")
    table.add_column("tensor")
    table.add_column("value", justify="right")
    table.add_row("responses shape (b, t)", str(tuple(batch.responses.shape)))
    table.add_row("ASSISTANT / OBSERVATION / PAD tokens",
                  " / ".join(str(int((batch.spans == k).sum())) for k in (1, 2, 0)))
    table.add_row("mean return on ASSISTANT tokens", f"{returns[mask].mean():.4f}")
    table.add_row("first-turn ASSISTANT tokens with nonzero return",
                  f"{int(((batch.turn_ids == 0) & mask & (returns != 0)).sum())}")
    table.add_row("advantage mean / std (ASSISTANT)", f"{adv[mask].mean():.3f} / {adv[mask].std():.3f}")
    table.add_row("max |return| on OBSERVATION/PAD", f"{returns.masked_fill(mask, 0).abs().max():.1f}")
    return table


def cmd_rollout(opts: RolloutOptions, task=None, save_config=None) -> int:
    """Play the episodes (after every check has passed), print the summary; 0, or 1 when nothing ran well."""
    model_path = preflight_rollout(opts)
    from transformers import AutoTokenizer

    from agent_loop.jsonl import OutputExistsError
    from agent_loop.plugins import load_task
    from agent_loop.runner import error_status, plan_output, stream_rollouts

    console = Console()
    task = task if task is not None else load_task(opts.task)
    out = Path(opts.out)
    try:  # before anything is loaded or opened: an existing --out is never touched without --resume/--append
        mode, todo = plan_output(out, range(opts.episodes), opts.seed, task.name, resume=opts.resume,
                                 append=opts.append)
    except (OSError, ValueError, OutputExistsError) as error:
        raise UsageError(f"--out {out}: {error}") from None
    if not todo:
        console.print(f"{out} already holds all {opts.episodes} episodes (seed {opts.seed}); nothing to play")
        return 0
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if save_config is not None:
        save_config(out.with_name(out.stem + ".config.yaml"))  # the resolved settings: rerun with --config
    backend = make_backend(opts, model_path)

    async def play():
        try:
            return await stream_rollouts(task, backend, tokenizer, todo, opts.loop_config(), seed=opts.seed,
                                         concurrency=opts.concurrency, output_path=out, output_mode=mode,
                                         sample_size=RETURNS_SAMPLE)
        finally:
            await close_backend(backend)  # vLLM: stop the engine now, not in a half-torn-down interpreter

    started = time.perf_counter()
    try:
        stats, _ = asyncio.run(play())
    except Exception as error:
        if getattr(error, "fatal", False):  # e.g. every server down past the deadline; finished episodes are kept
            raise SystemExit(f"agent-loop rollout stopped: {error}\n(finished episodes are in {out}; "
                             "rerun with --resume to play the rest)") from None
        raise
    elapsed = time.perf_counter() - started
    console.print(summary_table(stats, f"{task.name} rollout"))
    console.print(f"{stats.episodes / elapsed:.2f} episodes/s, {stats.assistant_tokens / elapsed:.0f} assistant "
                  f"tokens/s ({elapsed:.1f} s, concurrency {opts.concurrency}, backend {opts.backend}, "
                  f"model {model_path})")
    problem = failure_summary(stats)
    if problem is None:
        sample = sorted(stats.sample, key=lambda t: t.info["index"])
        console.print(returns_table(sample, tokenizer.pad_token_id or 0, opts.gamma, opts.estimator))
    console.print(f"wrote {stats.episodes} trajectories to {out}  (look inside: agent-loop inspect {out})")
    if problem is not None:
        Console(stderr=True).print(f"[red]error:[/red] {problem}", highlight=False, soft_wrap=True)
        return 1
    status, error_lines = error_status(stats, opts.max_error_fraction)
    for line in error_lines:
        console.print(line, markup=False)
    return status


def cmd_inspect(argv: list[str]) -> int:
    from agent_loop.inspect import main as inspect_main

    return inspect_main(argv)


def cmd_train(argv: list[str]) -> int:
    from trainer.cli import main as train_main

    return train_main(argv)


def main(argv: list[str] | None = None) -> int:
    """``agent-loop COMMAND ...``; returns the exit status (2: a usage error, reported in one line)."""
    argv = sys.argv[1:] if argv is None else argv
    # inspect and train own their options; hand them the rest of the command line unchanged
    delegated = {"inspect": cmd_inspect, "train": cmd_train}
    if argv and argv[0] in delegated:
        return delegated[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="agent-loop", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("rollout", help="play episodes and write them as JSON Lines (--help)", add_help=False)
    commands.add_parser("inspect", help="see spans, rewards, returns and advantages token by token (--help)")
    commands.add_parser("train", help="train the policy with RL on a task (--help)")
    if not argv or argv[0] != "rollout":
        parser.parse_args(argv)  # usage, --help, or an unknown command (exit 2)
    prog = "agent-loop rollout"
    try:
        from agent_loop.config import save_resolved_config

        parser = build_parser(prog)
        args, opts, task = parse_command(parser, argv[1:], RolloutOptions.task, validate)
        return cmd_rollout(opts, task, lambda path: save_resolved_config(args, parser, path))
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
