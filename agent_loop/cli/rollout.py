"""``agent-loop rollout``: play episodes of a task with a model, write them as JSON Lines, print a summary.

Options are :class:`RolloutOptions`: the run's (:class:`~agent_loop.runners.spec.RunOptions`), the
task's (:class:`~agent_loop.tasks.registry.TaskOptions`), the loop's
(:class:`~agent_loop.episode.loop_config.LoopConfig`), the servers' (:class:`~agent_loop.backends.server_options.ServerOptions`)
and the threads' (:class:`~agent_loop.threads.ThreadOptions`), plus this command's own. Every check runs before
anything starts; a bad value is one line on stderr naming the option, exit status 2 (docs/errors.md).

One output per run: ``--out`` is locked for the life of the run (``agent_loop.runners.outputs``); a
``--resume`` or ``--append`` with settings that change what an episode is (the loop's and the task's
options, the model, the seed) is refused unless ``--allow-config-change``. A stop by SIGINT/SIGTERM or a write that fails
(a full disk, a file size limit) is one line naming the file and the ``--resume`` command that goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field
from rich.console import Console

import agent_loop.cli.preflight as preflight
from agent_loop.backends.base import BackendSettings, is_fatal
from agent_loop.backends.registry import make_backend
from agent_loop.backends.server_options import ServerOptions
from agent_loop.backends.vllm_engine import engine_log
from agent_loop.cli.config_file import save_config
from agent_loop.cli.flags import UsageError, add_options, resolve, validate
from agent_loop.cli.stops import go_on_command
from agent_loop.cli.tables import failure_summary, returns_table, summary_table
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.model_folders import model_path
from agent_loop.options import OptionError, ProgressOptions, pick, plural
from agent_loop.proxy import AgentOptions
from agent_loop.proxy.agents import load_agent, stream_agent_rollouts
from agent_loop.runners.backend_choice import AUTO, BackendOptions, resolve_backend
from agent_loop.runners.jsonl import OutputExistsError, count_lines
from agent_loop.runners.local import error_status, plan_output, stream_rollouts
from agent_loop.runners.outputs import (
    OutputLockedError,
    RunLock,
    changed_settings,
    fresh_path,
    is_write_failure,
    refuse_changed,
)
from agent_loop.runners.spec import (
    EpisodesOptions,
    EstimatorOptions,
    ResumeOptions,
    RunOptions,
    RunSpec,
    check_group_estimator,
    check_row_estimator,
)
from agent_loop.tasks.grouping import GroupedTask
from agent_loop.tasks.registry import TaskOptions
from agent_loop.threads import ThreadOptions, apply_threads
from agent_loop.types import in_episode_order

DEFAULT_OUT = "runs/rollouts.jsonl"
RETURNS_SAMPLE = 256  # episodes (the lowest indices) the rollout's returns table is computed on
# what an episode is: a --resume/--append that changes one of these would mix two kinds of episodes in one file
EPISODE_SETTINGS = frozenset({f.name for cls in (LoopConfig, TaskOptions) for f in dataclasses.fields(cls)}
                             | {"model", "seed", "group_size"})


@dataclass
class RolloutOptions(AgentOptions, ThreadOptions, ProgressOptions, BackendOptions, ServerOptions, LoopConfig,
                     TaskOptions, ResumeOptions, EstimatorOptions, EpisodesOptions, RunOptions):
    """The options of ``agent-loop rollout`` (and the keys of its config file)."""

    out: Annotated[str | None, Field(description="JSON Lines file the episodes are written to as they finish; unset: "
                                     f"{DEFAULT_OUT}, or the first free {DEFAULT_OUT.replace('.jsonl', '-N.jsonl')} "
                                     "when that exists (an existing file is only added to with --resume/--append)",
                                     json_schema_extra={"allowed": "a file path (not a folder)"})] = None
    append: Annotated[bool, Field(description="append to an existing --out (without --resume/--append an "
                                  "existing non-empty --out is refused, never emptied)")] = False
    max_error_fraction: Annotated[float, Field(ge=0, le=1, description="exit status 1 when more episodes than "
                                               "this fraction end with an error")] = 0.1

    def check(self) -> None:
        """The rules across options (OptionError), then the default ``out``: never an earlier run's file."""
        TaskOptions.check(self)
        try:  # the declaration takes any registered estimator; a file of rollouts shows fewer
            check_row_estimator(self.estimator)
        except ValueError as error:
            raise OptionError("estimator", str(error).replace("{", "{{").replace("}", "}}"), self.estimator) from None
        if isinstance(self.resume, str):
            raise OptionError("resume", "takes no folder in rollout: it goes on with the file {out} names "
                              "({out} FILE {resume})", self.resume)
        if self.backend == "http" and not self.server:
            raise OptionError("backend", "needs at least one {server} URL (e.g. {server} http://127.0.0.1:8000)", "http")
        if self.resume and self.append:
            raise OptionError(None, "{resume} and {append} exclude each other: {resume} appends only the missing episodes")
        if self.served_model_name is not None and self.backend not in ("http", AUTO):
            raise OptionError("served_model_name", f"used by {{backend}} http only (got {{backend}} {self.backend})",
                              self.served_model_name)
        if self.server and self.backend not in ("http", AUTO):
            raise OptionError("server", f"used by {{backend}} http only (got {{backend}} {self.backend})", self.server[0])
        check_group_estimator(self.estimator, self.group_size)
        if self.out is None:  # README's command runs again without touching the last run's file
            self.out = DEFAULT_OUT if self.resume or self.append else fresh_path(DEFAULT_OUT)


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("rollout", help="play episodes and write them as JSON Lines (--help)",
                                 description="Play episodes of a task with a model and write them as JSON Lines; print "
                                 "a summary and the batch's returns and advantages (--estimator).")
    add_options(parser, RolloutOptions)
    parser.set_defaults(run=run, prog="agent-loop rollout")
    return parser


def run(args: argparse.Namespace) -> int:
    """Resolve the options (file, flags), check everything, play, print; the exit status."""
    opts = resolve(RolloutOptions, args)
    try:
        task = opts.load()
        if opts.group_size > 1:  # episode i plays question i // group_size, as train's steps do
            task = GroupedTask(task, opts.group_size, question_seed=opts.seed)
        if opts.agent:  # loaded now: a module that cannot load is a usage error before any model loads

            load_agent(opts.agent)
    except ValueError as error:  # PluginError: a plug-in that cannot load
        raise UsageError(str(error)) from None
    return play(opts, task, lambda path: save_config(dataclasses.asdict(opts), path), args=args)


def options_from(values: dict, *, keys: bool = False) -> RolloutOptions:
    """Checked options from ``values`` (flags, or a config file's keys with ``keys=True``); UsageError."""
    return validate(RolloutOptions, values, keys=keys)


def check_world(opts: RolloutOptions, task=None) -> str:
    """Check the model folder, the output path and the servers; return the model path. Reads only.
    ``opts.backend`` becomes the backend that plays (``agent_loop.runners.backend_choice.resolve_backend``: ``http``
    with ``--server``, ``auto`` by the rule; its note on stderr)."""
    path = preflight.builtin_folder(opts.model) if opts.model else model_path(None)
    opts.backend, note = resolve_backend(opts.backend, path, servers=opts.server)
    if note:
        print(f"agent-loop rollout: {note}", file=sys.stderr, flush=True)
    if opts.model is not None:
        preflight.check_model_dir(opts.model, opts.backend, task=task)
    if opts.backend == "vllm":
        preflight.check_vllm_binding(opts.threads)
    preflight.check_output_file(opts.out)
    if opts.backend == "http":
        preflight.probe_servers(opts.server, model=opts.served_name(path))
    return path


def go_on(opts: RolloutOptions, argv: list[str] | None) -> str:
    """The command that plays the rest of this run: its own arguments, ``--out`` made explicit, ``--resume``."""
    return go_on_command("agent-loop rollout", list(argv or []), drop={"--out": True, "--resume": False,
                         "--append": False}, add=["--out", str(opts.out), "--resume"])


def held_note(out: Path, argv: list[str] | None, opts: RolloutOptions):
    """What a stop leaves behind: how many whole episodes ``out`` holds, and the command that goes on."""
    return lambda: (f"{out} holds {plural(count_lines(out), 'whole episode')} (each line one finished episode); "
                    f"to play the rest: {go_on(opts, argv)}")


def check_resume_settings(opts: RolloutOptions, saved_path: Path) -> None:
    """Refuse a ``--resume`` or ``--append`` whose episodes would differ from those already in ``--out`` (their
    settings saved at ``saved_path``) unless ``--allow-config-change``; then the differences are a warning."""
    flag = "--resume" if opts.resume else "--append"
    if not saved_path.is_file():
        warnings.warn(f"{flag}: no saved settings ({saved_path}) to compare this run's with", stacklevel=2)
        return
    try:
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(f"{flag}: cannot read the saved settings {saved_path}: {error}") from None
    refuse_changed(changed_settings(saved, dataclasses.asdict(opts), EPISODE_SETTINGS),
                   allowed=opts.allow_config_change, warning=f"{flag} with changed settings ({saved_path} keeps the "
                   "first run's)", refusal=lambda listing: UsageError(
                       f"{flag}: settings differ from those the episodes in {opts.out} were played with "
                       f"({saved_path}): {listing} (pass --allow-config-change to add such episodes to it anyway)"))


def play(opts: RolloutOptions, task, save_options=None, *, args: argparse.Namespace | None = None) -> int:
    """Play the episodes (after every check has passed), print the summary; 0, or 1 when nothing ran well.

    ``--out`` is locked from before it is read until the run ends (a second run into it is refused)."""
    path = check_world(opts, task)
    out = Path(opts.out)
    try:
        lock = RunLock(out).acquire()
    except (OutputLockedError, OSError) as error:
        raise UsageError(f"--out {out}: {error}") from None
    try:
        return _play_locked(opts, task, save_options, path, out, args)
    finally:
        lock.release()


def _play_locked(opts: RolloutOptions, task, save_options, path: str, out: Path, args) -> int:
    from transformers import AutoTokenizer  # torch: every command's module loads at the CLI's start

    argv = getattr(args, "argv", None)
    try:  # before anything is loaded or opened: an existing --out is never touched without --resume/--append
        mode, todo, total = plan_output(out, range(opts.episodes), opts.seed, task.name, resume=opts.resume,
                                        append=opts.append)
    except (OSError, ValueError, OutputExistsError) as error:
        raise UsageError(f"--out {out}: {error}") from None
    saved = out.with_name(out.stem + ".config.yaml")
    if opts.resume or (opts.append and out.is_file() and out.stat().st_size > 0):  # episodes to add to
        check_resume_settings(opts, saved)
    if not total:
        Console().print(f"{out} already holds {'all ' * (opts.episodes > 1)}{plural(opts.episodes, 'episode')} "
                        f"(seed {opts.seed}); nothing to play")
        return 0
    if args is not None:
        args.stop_note = held_note(out, argv, opts)
    tokenizer = AutoTokenizer.from_pretrained(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if save_options is not None and (mode == "new" or not saved.exists()):  # the settings the episodes were played with
        save_options(saved)  # rerun with --config
    spec = RunSpec(task, tokenizer, todo, LoopConfig(**pick(LoopConfig, opts)), opts.seed, out, mode,
                   progress=opts.progress, info=opts.made_with(pick(TaskOptions, opts)))  # inspect reads them
    stats, timing = _stream(opts, spec, path, out, total, argv)
    if not report(opts, stats, tokenizer, timing, path, out, task.name):
        return 1

    status, error_lines = error_status(stats, opts.max_error_fraction)
    for line in error_lines:
        Console().print(line, markup=False)
    return status


@dataclass
class Timing:
    """Where a run's time went (``time.perf_counter`` seconds): starting the backend (loading the model, starting
    the engine), playing (from the first request to the last episode's end), stopping it."""

    started: float
    ready: float = 0.0
    played: float = 0.0
    stopped: float = 0.0

    @property
    def start_up_s(self) -> float:
        return self.ready - self.started

    @property
    def playing_s(self) -> float:
        return self.played - self.ready

    @property
    def stop_s(self) -> float:
        return self.stopped - self.played


def engine_log_of(opts: RolloutOptions, out: Path) -> str | None:
    """Where ``--backend vllm``'s engine logs go: ``<out>.vllm.log`` beside the output (the first free name), or
    the terminal (None) with ``--verbose`` or a ``VLLM_LOGGING_LEVEL`` of the user's."""
    if opts.backend != "vllm":
        return None
    log = engine_log(fresh_path(str(out.with_name(out.stem + ".vllm.log"))), verbose=opts.verbose)
    return None if log is None else str(log)


def _stream(opts: RolloutOptions, spec: RunSpec, path: str, out: Path, total: int, argv: list[str] | None):
    """Start the backend, play, stop it: the stats and the :class:`Timing`."""
    threads = apply_threads(opts.threads)  # vllm on CPU: its engine's threads bound to as many cores
    timing = Timing(started=time.perf_counter())
    backend = make_backend(opts.backend, path, BackendSettings.from_options(  # --server, deadlines
        opts, threads=threads, engine_log=engine_log_of(opts, out), dtype=opts.rollout_torch_dtype()))
    timing.ready = time.perf_counter()

    async def play_all():
        try:
            if opts.agent:  # the user's own agent, through an in-process recording proxy (docs/agents.md)

                played = await stream_agent_rollouts(spec, backend, load_agent(opts.agent), concurrency=opts.concurrency,
                                                     sample_size=RETURNS_SAMPLE, total=total,
                                                     timeout_s=opts.agent_timeout_s)
            else:
                played = await stream_rollouts(spec, backend, concurrency=opts.concurrency, sample_size=RETURNS_SAMPLE,
                                               total=total)
            timing.played = time.perf_counter()
            return played
        finally:
            backend.close()  # vLLM: stop the engine now, not in a half-torn-down interpreter
            timing.stopped = time.perf_counter()

    try:
        stats, _ = asyncio.run(play_all())
    except Exception as error:
        if is_fatal(error):  # e.g. every server down past the deadline; finished episodes are kept
            raise SystemExit(f"agent-loop rollout stopped: {error}\n(finished episodes are in {out}; "
                             "rerun with --resume to play the rest)") from None
        if is_write_failure(error):  # a full disk or a file size limit: the partial line was cut
            raise SystemExit(f"agent-loop rollout stopped: {error}; {out} holds "
                             f"{plural(count_lines(out), 'whole episode')}; "
                             f"make room (or raise the file size limit), then: {go_on(opts, argv)}") from None
        raise
    return stats, timing


def speed_line(stats, timing: Timing, opts: RolloutOptions, path: str) -> str:
    """The warm generation speed (from the first request to the last episode's end) and, apart, the start-up
    and stop times."""
    playing = max(timing.playing_s, 1e-9)
    return (f"{stats.episodes / playing:.2f} episodes/s, {stats.assistant_tokens / playing:.0f} assistant tokens/s "
            f"warm ({timing.playing_s:.1f} s, first request to last episode's end); start-up {timing.start_up_s:.1f} s, "
            f"stop {timing.stop_s:.1f} s (not counted); concurrency {opts.concurrency}, backend {opts.backend}, "
            f"model {path}")


def report(opts: RolloutOptions, stats, tokenizer, timing: Timing, path: str, out: Path, name: str) -> bool:
    """The summary, the speed, the returns table and where it went; False (and why, on stderr) when there was
    nothing to compute returns on."""
    console = Console()
    console.print(summary_table(stats, f"{name} rollout" + (", played by --resume" if opts.resume else "")))
    console.print(speed_line(stats, timing, opts, path), highlight=False)
    problem = failure_summary(stats)
    if problem is None:
        console.print(returns_table(in_episode_order(stats.sample), tokenizer.pad_token_id or 0, opts))
    segments = f" ({plural(stats.episodes, 'episode')})" if stats.segments != stats.episodes else ""
    console.print(f"wrote {plural(stats.segments, 'trajectory', 'trajectories')}{segments} to {out}  (look inside: "
                  f"agent-loop inspect {out})")
    if problem is not None:
        Console(stderr=True).print(f"[red]error:[/red] {problem}", highlight=False, soft_wrap=True)
    return problem is None
