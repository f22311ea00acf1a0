"""Issue 37 item 8 (inspect part): the views are library code that returns data; argv, messages and exit codes
live in agent_loop/cli/inspect.py. ``agent_loop.inspect.run(args)`` and ``runs.run(args, console, err)`` took
argparse namespaces and returned exit codes."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import agent_loop.inspect as views


def test_no_view_module_takes_parsed_options_or_returns_an_exit_status():
    names = [m.name for m in pkgutil.iter_modules(views.__path__) if m.name != "__main__"]
    assert {"runs", "steps", "view", "plots", "html", "terminal"} <= set(names)
    for name in ["__init__", *names]:
        path = Path(views.__path__[0]) / f"{name}.py"
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {"argparse", "sys"} & imported, f"{path} parses or exits"
        params = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
        assert "args" not in params, f"{path}: a function takes the command's parsed options"
    assert not hasattr(views, "run") and not hasattr(importlib.import_module("agent_loop.inspect.runs"), "run")


def test_the_command_returns_the_exit_statuses(tmp_path, capsys):
    from agent_loop.cli.inspect import main

    assert main([str(tmp_path / "missing.jsonl")]) == 2  # not readable: one line, exit 2
    assert "cannot read" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main([str(empty)]) == 1 and "nothing to render" in capsys.readouterr().err
