"""Objects named by a string on the command line or in a config: ``package.module:Name`` or
``path/to/file.py[:Name]`` (``--task``, ``--tools``, ``--reward``, ``--agent``, ``--summarizer``).

A ``.py`` file imports like a script: the modules beside it import (its folder goes on ``sys.path``). Every
failure is a :class:`PluginError` that says which option, what was asked for and what went wrong. Imports
nothing of agent-loop's, so the episode loop (``--summarizer``), the proxy (``--agent``) and the tasks
(agent_loop/tasks/plugins.py makes tasks, tools and rewards of them) load plug-ins one way.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A plug-in (task, tools, reward) named on the command line or in a config cannot be used."""


def import_module(spec: str, option: str, shown: str | None = None):
    """A module by dotted name or ``.py`` file path; PluginError with the reason if it does not import
    (naming ``option`` and ``shown``, the string the user gave; default ``spec``)."""
    shown = shown or spec
    path = Path(spec)
    try:
        if spec.endswith(".py") or path.is_file():
            if not path.is_file():
                raise PluginError(f"{option} {shown!r}: file not found")
            name = f"agent_loop_plugin_{path.stem}_{abs(hash(str(path.resolve())))}"
            if name in sys.modules:
                return sys.modules[name]
            _importable_beside(path)
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
        return importlib.import_module(spec)
    except PluginError:
        raise
    except ModuleNotFoundError as error:
        where = (f"{error.name!r} is neither installed nor a module beside {path.name}" if path.is_file()
                 else "a dotted module on the Python path (PYTHONPATH=. for the current folder), or a path to a .py file")
        raise PluginError(f"{option} {shown!r} does not import: {error} ({where})") from None
    except Exception as error:
        raise PluginError(f"{option} {shown!r} does not import: {type(error).__name__}: {error}") from error


def _importable_beside(path: Path) -> None:
    """Put a plug-in file's folder on ``sys.path``, as ``python file.py`` does, so the file can import its
    neighbours (at load time and later, from inside its functions)."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)


def import_object(spec: str, option: str) -> tuple[Any, Any]:
    """``module:Name`` -> ``(module, object)``; ``module`` alone -> ``(module, None)``."""
    module_part, _, attribute = spec.rpartition(":") if ":" in spec and not _is_drive(spec) else (spec, "", "")
    module = import_module(module_part, option, shown=spec)
    if not attribute:
        return module, None
    if not hasattr(module, attribute):
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attribute, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PluginError(f"{option} {spec!r}: no {attribute!r} in {module_part}{hint}")
    return module, getattr(module, attribute)


def _is_drive(spec: str) -> bool:
    return len(spec) > 1 and spec[1] == ":" and spec[0].isalpha() and spec.count(":") == 1  # C:\\tasks.py
