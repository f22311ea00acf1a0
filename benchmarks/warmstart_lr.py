"""Which learning rate (and how many steps) a warm start of a real model needs (issue 49 item 2): a grid of
``agent-loop warmstart`` runs of SmolLM2-135M (``--model smollm2-135m``) over tasks x learning rates x seeds (x
steps), each judged by the warm start's own held-out check (``--check-episodes`` questions of train's evaluation
stream, sampled at T=1, never the demonstrations' questions); a table of the success per cell and its mean over
seeds.

    nice -n 10 .venv/bin/python benchmarks/warmstart_lr.py --tasks arithmetic lookup --lrs 1e-5 1e-4 3e-4 --seeds 0
    nice -n 10 .venv/bin/python benchmarks/warmstart_lr.py --table        # the table of what is in the results file

Each cell is ``agent_loop.recipes.warmstart.warm_start`` with the CLI's options (``WarmstartConfig``) into
``WORKDIR/TASK-lrLR-sSEED-stSTEPS``; its row is appended to ``--results`` (JSON Lines) when it ends, and the model
folder is deleted (540 MB each). Rerunning skips the cells the results file holds, and a cell whose folder holds a
finished run with the same settings (its config.yaml, metrics of every step, a full check.jsonl) is read, not run
again: a stopped grid goes on. Several processes may share one grid (``--workers``): each claims a cell by creating
``WORKDIR/CELL.claim`` (a claim whose process is gone is taken over).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "warmstart_lr.jsonl"


def cell_name(task: str, lr: float, seed: int, steps: int) -> str:
    return f"{task}-lr{lr:g}-s{seed}-st{steps}"


def settings(args, task: str, lr: float, seed: int, steps: int) -> dict:
    """The cell's ``WarmstartConfig`` options (besides output_dir, progress, threads: how it runs, not what)."""
    return {"task": task, "model": args.model, "lr": lr, "seed": seed, "steps": steps, "batch_size": args.batch_size,
            "episodes": args.episodes, "check_episodes": args.check_episodes}


def row_of(folder: Path, cell: dict, seconds: float | None) -> dict | None:
    """The cell's result read from its finished run folder, or None when the run there is not finished (or is
    another cell's)."""
    from agent_loop.recipes.warmstart import CHECK_FILE

    try:
        import yaml

        saved = yaml.safe_load((folder / "config.yaml").read_text())
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        check = [json.loads(line) for line in (folder / CHECK_FILE).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if any(saved.get(key) != value for key, value in cell.items()) or len(metrics) != cell["steps"]:
        return None
    if len(check) != cell["check_episodes"]:
        return None
    calls = [c for t in check for c in t["tool_calls"]]
    k = max(1, min(5, len(metrics) // 2))
    return {**cell, "success": sum(bool(t["info"].get("success")) for t in check) / len(check),
            "tool_calls": len(calls) / len(check),
            "tool_errors": sum(bool(c.get("error_kind")) for c in calls) / len(check),
            "malformed": sum(c.get("error_kind") == "malformed_json" for c in calls) / len(check),
            "loss_first": sum(m["loss"] for m in metrics[:k]) / k, "loss_last": sum(m["loss"] for m in metrics[-k:]) / k,
            "seconds": seconds, "threads": saved.get("threads"), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def claim(path: Path) -> bool:
    """Create ``path`` holding this process's id; take it over when the process it names is gone."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(path.read_text() or 0), 0)
                return False  # its process runs
            except (ProcessLookupError, ValueError):
                path.unlink(missing_ok=True)
                continue
            except PermissionError:
                return False
        with os.fdopen(fd, "w") as claim_file:
            claim_file.write(str(os.getpid()))
        return True
    return False


def done_cells(results: Path) -> dict[str, dict]:
    if not results.exists():
        return {}
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {cell_name(r["task"], r["lr"], r["seed"], r["steps"]): r for r in rows}


def append_row(results: Path, row: dict) -> None:
    """One line, appended in one write (O_APPEND): rows of processes sharing the grid never interleave."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def run_cell(args, cell: dict, folder: Path) -> dict:
    from agent_loop.recipes.warmstart import warm_start
    from agent_loop.recipes.warmstart_options import WarmstartConfig

    if folder.exists():
        shutil.rmtree(folder)  # an unfinished run of this cell: start it again
    started = time.perf_counter()
    config = WarmstartConfig(**cell, output_dir=str(folder), progress=False, threads=args.threads)
    from agent_loop.cli.config_file import save_config

    folder.mkdir(parents=True)
    save_config(config.resolved(), folder / "config.yaml")  # as the CLI saves it
    warm_start(config)
    return row_of(folder, cell, time.perf_counter() - started)


def run_grid(args) -> None:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for task, lr, seed, steps in itertools.product(args.tasks, args.lrs, args.seeds, args.steps):
        name, cell = cell_name(task, lr, seed, steps), settings(args, task, lr, seed, steps)
        if name in done_cells(args.results):
            continue
        claimed = workdir / f"{name}.claim"
        if not claim(claimed):
            continue
        try:
            folder = workdir / name
            row = row_of(folder, cell, None)  # a finished run left there: read, not run again
            print(f"{name}: {'read from ' + str(folder) if row else 'running'}", flush=True)
            row = row or run_cell(args, cell, folder)
            append_row(args.results, row)
            shutil.rmtree(folder / "model", ignore_errors=True)
            print(f"{name}: success {row['success']:.3f} ({args.check_episodes} held-out episodes, sampled at T=1), "
                  f"loss {row['loss_first']:.3f} -> {row['loss_last']:.4f}, "
                  f"{row['seconds'] or 0:.0f} s", flush=True)
        finally:
            claimed.unlink(missing_ok=True)


def print_table(results: Path) -> None:
    """Per task, steps and learning rate: the success of each seed and their mean (markdown)."""
    rows = list(done_cells(results).values())
    if not rows:
        print(f"no results in {results}")
        return
    print("| task | steps x batch | lr | seeds | held-out success (sampled, T=1) per seed | mean | tool calls / ep | "
          "malformed calls / ep | loss first -> last | minutes per cell |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    key = lambda r: (r["task"], r["steps"], r["batch_size"], r["lr"])  # noqa: E731
    for (task, steps, batch, lr), group in itertools.groupby(sorted(rows, key=lambda r: (*key(r), r["seed"])), key=key):
        group = list(group)
        mean = lambda name: sum(r[name] for r in group) / len(group)  # noqa: E731
        per_seed = ", ".join(f"s{r['seed']} {r['success']:.3f}" for r in group)
        timed = [r["seconds"] for r in group if r["seconds"]]
        minutes = f"{sum(timed) / len(timed) / 60:.1f}" if timed else "-"
        print(f"| {task} | {steps} x {batch} | {lr:g} | {len(group)} | {per_seed} | {mean('success'):.3f} | "
              f"{mean('tool_calls'):.2f} | {mean('malformed'):.2f} | {mean('loss_first'):.3f} -> "
              f"{mean('loss_last'):.4f} | {minutes} |")
    checks = {r["check_episodes"] for r in rows}
    print(f"\nsuccess: the warm start's held-out check, {'/'.join(map(str, sorted(checks)))} episodes per cell "
          f"(train's evaluation questions), sampled at T=1; demonstrations: {rows[0]['episodes']} per cell")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["arithmetic", "lookup"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-5, 1e-4, 3e-4])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", nargs="+", type=int, default=[20])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=64, help="demonstrations per cell")
    parser.add_argument("--check-episodes", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--workdir", default="/tmp/warmstart_lr")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--table", action="store_true", help="only print the table of the results file")
    args = parser.parse_args(argv)
    if not args.table:
        run_grid(args)
    print_table(args.results)


if __name__ == "__main__":
    main()
