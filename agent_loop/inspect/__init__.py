"""``agent-loop inspect ROLLOUTS.jsonl [OTHER.jsonl]``: see spans, rewards, returns and advantages token by token.

Views: the terminal (rich: a summary and the few most informative episodes; ``--all`` for every
one), ``--html OUT.html`` (one self-contained page with in-page filters), ``--png OUT.png``
(matplotlib), and ``--compare`` (carry-through vs. reset-at-observation vs. ignoring the mask).
With two files, the runs are compared episode by episode (matched by ``info.index`` and seed).

The file is read one line at a time: memory grows with the episodes shown, not with the file.
Bad lines are reported on stderr with FILE:LINE, and the good lines still render.
Exit status: 0 when episodes were rendered; 1 when nothing could be (no good line, no episode
matching the selection); 2 on a usage error or an input that is not a JSON Lines file.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from agent_loop.inspect.choices import INFORMATIVE
from agent_loop.inspect.load import InputError
from agent_loop.inspect.output import write_atomically

__all__ = ["run"]


def selection_of(args):
    from agent_loop.inspect.view import Selection

    if args.episode:
        ids = list(dict.fromkeys(args.episode))
        return Selection("ids", len(ids), ids, args.failed)
    if args.worst:
        return Selection("worst", args.worst, failed=args.failed)
    if args.all:
        return Selection("all", args.max_episodes, failed=args.failed)
    return Selection("informative", INFORMATIVE, failed=args.failed, keep_first=args.max_episodes if args.html else 0)


def run(args, console: Console | None = None) -> int:
    """Render what ``args`` asks for (the options of ``agent-loop inspect``, parsed by
    ``agent_loop.cli.inspect``: ``rollouts``, ``episode``, ``worst``, ...); returns the exit status."""
    from agent_loop.inspect.view import build_view, scan

    console = console or Console(width=args.width)
    err = Console(stderr=True, width=args.width, soft_wrap=True, highlight=False)
    if len(args.rollouts) == 2:
        from agent_loop.inspect.runs import run as compare_runs

        return compare_runs(args, console, err)
    path = args.rollouts[0]
    try:
        scanned = scan(path, selection_of(args), args.gamma, args.compare, estimator=args.estimator)
    except InputError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    for problem in scanned.problems.lines():
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if scanned.summary.episodes == 0:
        err.print(f"[red]error:[/red] {path}: nothing to render (no good line)")
        return 1
    if scanned.wanted_ids_missing:
        s = scanned.summary
        err.print(f"[red]error:[/red] {path}: no episode with info.index {', '.join(map(str, scanned.wanted_ids_missing))} "
                  f"(--episode; the file's episodes run from {s.first_index} to {s.last_index})")
        return 1
    view = build_view(scanned, tokenizer_dir=args.tokenizer)
    for problem in view.problems[len(scanned.problems.lines()):]:
        err.print(f"[yellow]warning:[/yellow] {problem}")
    if getattr(args, "color_by", "span") == "version" and not any(t.policy_versions for t in view.trajectories):
        err.print("[yellow]warning:[/yellow] --color-by version: the episodes shown record no policy versions "
                  "(the trainer's step files do: OUTPUT_DIR/rollouts/); coloured by span")
    if not args.quiet:
        from agent_loop.inspect.terminal import render

        render(view, console, values=args.values or bool(args.worst), compare=args.compare, all_mode=bool(args.all),
               color_by=getattr(args, "color_by", "span"))
    if args.html:
        from agent_loop.inspect.html import render as render_html

        page = render_html(view, compare=args.compare)
        write_atomically(args.html, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
        err.print(f"wrote {args.html}")
    if args.png:
        from agent_loop.inspect.plots import render as render_png

        write_atomically(args.png, lambda tmp: render_png(view, tmp, compare=args.compare))
        err.print(f"wrote {args.png}")
    if not view.trajectories:
        err.print("[red]error:[/red] no episode matches the selection")
        return 1
    return 0
