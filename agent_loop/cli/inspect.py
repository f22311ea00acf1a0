"""``agent-loop inspect ROLLOUTS.jsonl [OTHER.jsonl] | RUN_FOLDER``: its options, messages and exit status;
the views (which return data and render it) are :mod:`agent_loop.inspect`'s.

Exit status: 0 when something was rendered; 1 when nothing could be (no good line, no episode matching
the selection, no matched pair, a run folder without steps); 2 on a usage error or an input that is not a
JSON Lines file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from agent_loop.cli.flags import USAGE_EXIT, UsageError, add_common_options, int_at_least, number_in, threads_from
from agent_loop.cli.preflight import builtin_folder
from agent_loop.files import write_file
from agent_loop.inspect.choices import INFORMATIVE, LABEL, TURN_ESTIMATORS
from agent_loop.inspect.load import InputError
from agent_loop.threads import apply_threads

PROG = "agent-loop inspect"
DESCRIPTION = "see spans, rewards, returns and advantages token by token"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``agent-loop inspect`` (and of ``python -m agent_loop.inspect``)."""
    parser.add_argument("rollouts", nargs="+", metavar="ROLLOUTS.jsonl",
                        help="JSON Lines file, one Trajectory per line; give two files to compare two runs; "
                             "or a training run's folder (OUTPUT_DIR of agent-loop train) to see it over its steps")
    parser.add_argument("--episode", type=int_at_least(0), action="append", metavar="N",
                        help="show the episode whose info.index is N (a session: every segment, in order); "
                             "repeatable")
    parser.add_argument("--worst", type=int_at_least(1), nargs="?", const=1, metavar="K",
                        help="show the K lowest-reward episodes with their values per token (as --values; default K: 1)")
    parser.add_argument("--failed", action="store_true", help="only failed episodes")
    parser.add_argument("--all", action="store_true",
                        help=f"show every episode (up to --max-episodes), not only the {INFORMATIVE} most informative")
    parser.add_argument("--values", action="store_true",
                        help="terminal: a table per turn with each token's logprob, reward, return and advantage")
    parser.add_argument("--color-by", choices=("span", "version", "turn-advantage"), default="span",
                        help="terminal: colour tokens by span (default), or assistant tokens by the policy version "
                             "that sampled them (the trainer's step files; an episode that ran across a "
                             "weight update shows both), or by their turn's advantage")
    parser.add_argument("--turns", action="store_true",
                        help="terminal: the per-turn view: assistant tokens coloured by their turn's advantage and a "
                             "table per episode of each turn's tokens, reward, return, advantage and the anchor-state "
                             "group it joined (train --estimator gigpo's step files); on for a file whose episodes "
                             "record a turn-level estimator (turn_returns, turn_rloo, turn_index_normalized, gigpo, "
                             "turn_gae)")
    parser.add_argument("--compare", action="store_true",
                        help="returns under carry-through, reset-at-observation and ignore-mask side by side")
    parser.add_argument("--estimator", choices=list(LABEL), default=None,
                        help="registered estimator whose returns and (whitened) advantages are computed "
                             "(default: info['estimator'] of the file, else reinforce_plus_plus, carry-through); "
                             "episodes of a training step file show the step's own values")
    parser.add_argument("--gamma", type=number_in(ge=0, le=1), default=None,
                        help="discount of the returns, in [0, 1] (default: info['gamma'] of the file, else 1.0)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="local tokenizer folder (default: each trajectory's info['model_path'])")
    parser.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    parser.add_argument("--png", metavar="OUT.png", help="write matplotlib figures to a PNG")
    parser.add_argument("--max-episodes", type=int_at_least(1), default=100, metavar="N",
                        help="the most episodes kept for --all and the HTML page (default 100; the summary covers all)")
    parser.add_argument("--match", choices=("index", "prompt"), default=None,
                        help="two files: pair episodes by (info.index, info.seed) or by prompt (the k-th episode "
                             "of a prompt in each); default: by prompt for two step files of a run, else by index")
    parser.add_argument("--width", type=int_at_least(20), help="terminal width, at least 20 (default: detected)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no terminal view (with --html/--png)")
    return add_common_options(parser)


ONE_FILE_ONLY = ("png", "worst", "values", "compare", "turns")
EPISODE_OPTIONS = ("episode", "worst", "failed", "values", "compare", "estimator", "gamma", "tokenizer", "match",
                   "turns")


def check_arguments(args: argparse.Namespace) -> None:
    """Usage errors (exit 2) before any file is read or written."""
    if len(args.rollouts) > 2:
        raise UsageError(f"give one file to inspect or two to compare, got {len(args.rollouts)}")
    for name in ("html", "png"):
        out = getattr(args, name)
        if out is None:
            continue
        path = Path(out)
        if path.is_dir():
            raise UsageError(f"--{name} {out}: is a folder, expected a file name")
        if not path.parent.is_dir():
            raise UsageError(f"--{name} {out}: the folder {path.parent} does not exist")
        if path.resolve() in {Path(r).resolve() for r in args.rollouts}:
            raise UsageError(f"--{name} {out}: is an input file; it would be overwritten")
    if len(args.rollouts) == 2:
        for name in ONE_FILE_ONLY:
            if getattr(args, name):
                raise UsageError(f"--{name} shows one run; with two files give --all, --episode, --failed, --html")
    elif args.match:
        raise UsageError("--match pairs the episodes of two files: give two")
    if sum(x is not None and x is not False for x in (args.episode, args.worst, args.all or None)) > 1:
        raise UsageError("--episode, --worst and --all choose episodes in different ways: give one of them")
    if len(args.rollouts) == 1 and Path(args.rollouts[0]).is_dir():
        given = [name for name in EPISODE_OPTIONS if getattr(args, name) not in (None, False)]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} shows episodes; {args.rollouts[0]} is a run folder, "
                             "shown over its steps (give one of its step files, rollouts/step_NNNNNN.jsonl, "
                             "for episodes)")


def add_parser(commands) -> argparse.ArgumentParser:
    parser = add_arguments(commands.add_parser("inspect", help=f"{DESCRIPTION} (--help)", description=DESCRIPTION))
    parser.set_defaults(run=run, prog=PROG)
    return parser


def consoles(args: argparse.Namespace):
    return Console(width=args.width), Console(stderr=True, width=args.width, soft_wrap=True, highlight=False)


def written(err, path: str, write) -> None:
    write_file(path, write)  # through a temporary file: an existing output is replaced only once complete
    err.print(f"wrote {path}")


def selection_of(args: argparse.Namespace):
    """The episodes the options choose (--episode, --worst, --all, --failed, --max-episodes)."""
    from agent_loop.inspect.view import Selection  # torch: every command loads with the torch-free rollout path

    if args.episode:
        ids = list(dict.fromkeys(args.episode))
        return Selection("ids", len(ids), ids, args.failed)
    if args.worst:
        return Selection("worst", args.worst, failed=args.failed)
    if args.all:
        return Selection("all", args.max_episodes, failed=args.failed)
    return Selection("informative", INFORMATIVE, failed=args.failed, keep_first=args.max_episodes if args.html else 0)


def one_file(args: argparse.Namespace, console, err) -> int:
    """``agent-loop inspect ROLLOUTS.jsonl``: the summary and the chosen episodes."""
    from agent_loop.inspect.view import build_view, scan  # torch: every command loads with the torch-free rollout path

    path = args.rollouts[0]
    scanned = scan(path, selection_of(args), args.gamma, args.compare, estimator=args.estimator)
    for problem in scanned.problems.lines():
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if scanned.summary.episodes == 0:
        return failed(err, f"{path}: nothing to render (no good line)")
    if scanned.wanted_ids_missing:
        s = scanned.summary
        return failed(err, f"{path}: no episode with info.index {', '.join(map(str, scanned.wanted_ids_missing))} "
                           f"(--episode; the file's episodes run from {s.first_index} to {s.last_index})")
    view = build_view(scanned, tokenizer_dir=args.tokenizer)
    for problem in view.problems[len(scanned.problems.lines()):]:
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if args.color_by == "version" and not any(t.policy_versions for t in view.trajectories):
        err.print("[yellow]warning:[/yellow] --color-by version: the episodes shown record no policy versions "
                  "(the trainer's step files do: OUTPUT_DIR/rollouts/); coloured by span")
    turn_level = args.turns or any(t.info.get("estimator") in TURN_ESTIMATORS for t in view.trajectories)
    if not args.quiet:
        from agent_loop.inspect.terminal import render  # torch: every command loads with the torch-free rollout path

        render(view, console, values=args.values or bool(args.worst), compare=args.compare, all_mode=bool(args.all),
               color_by="turn-advantage" if turn_level and args.color_by == "span" else args.color_by,
               turns_view=turn_level or args.color_by == "turn-advantage")
    if args.html:
        # torch: every command loads with the torch-free rollout path
        from agent_loop.inspect.html import render as render_html

        page = render_html(view, compare=args.compare)
        written(err, args.html, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    if args.png:
        # torch: every command loads with the torch-free rollout path
        from agent_loop.inspect.plots import render as render_png

        written(err, args.png, lambda tmp: render_png(view, tmp, compare=args.compare))
    return 0 if view.trajectories else failed(err, "no episode matches the selection")


def two_files(args: argparse.Namespace, console, err) -> int:
    """``agent-loop inspect A.jsonl B.jsonl``: the two runs episode by episode."""
    # torch: every command loads with the torch-free rollout path
    from agent_loop.inspect.runs import compare, render_html, render_terminal

    c = compare(*args.rollouts, ids=args.episode, show_all=bool(args.all), limit=args.max_episodes,
                failed=args.failed, match=args.match)
    for problem in c.problems:
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if not c.runs[0] or not c.runs[1]:
        return failed(err, "nothing to compare: " + " and ".join(
            str(p) for p, r in zip(c.paths, c.runs) if not r) + " has no good line")
    if not args.quiet:
        render_terminal(c, console, args.tokenizer, bool(args.all), args.max_episodes)
    if args.html:
        page = render_html(c, args.tokenizer, args.max_episodes if args.all else 1000)
        written(err, args.html, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return 0 if c.pairs else failed(err, c.no_match())


def run_folder(args: argparse.Namespace, console, err) -> int:
    """``agent-loop inspect RUN_FOLDER``: the training run over its steps."""
    from agent_loop.inspect import steps  # torch: every command loads with the torch-free rollout path

    folder = args.rollouts[0]
    if not steps.is_run_folder(folder):
        return failed(err, f"{folder}: is a folder without metrics.jsonl or rollouts/step_NNNNNN.jsonl; give a "
                           "JSON Lines file of episodes, or the OUTPUT_DIR of agent-loop train", status=2)
    run = steps.read_run(folder)
    for problem in run.problems:
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if not run.rows:
        return failed(err, f"{folder}: no step recorded yet")
    if not args.quiet:
        console.print(steps.table(run, console.width, None if args.all else steps.TABLE_ROWS))
    if args.html:
        page = steps.render_html(run)
        written(err, args.html, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    if args.png:
        written(err, args.png, lambda tmp: steps.render_png(run, tmp))
    return 0


def failed(err, message: str, status: int = 1) -> int:
    err.print(f"[red]error:[/red] {message}")
    return status


def run(args: argparse.Namespace) -> int:
    """The views ``args`` asks for; returns the exit status."""
    check_arguments(args)
    apply_threads(threads_from(args))
    if args.tokenizer is not None:  # a built-in model's name (agent-loop models): its folder

        args.tokenizer = builtin_folder(args.tokenizer, "--tokenizer")
    console, err = consoles(args)
    view = (two_files if len(args.rollouts) == 2 else run_folder if Path(args.rollouts[0]).is_dir() else one_file)
    try:
        return view(args, console, err)
    except InputError as exc:
        return failed(err, str(exc), status=2)


def main(argv: list[str] | None = None) -> int:
    """``agent-loop inspect ARGV`` on its own (``python -m agent_loop.inspect``)."""
    args = add_arguments(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)).parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_EXIT
