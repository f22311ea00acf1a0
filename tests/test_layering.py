"""The architecture as rules: which package may import what, no import cycles, short functions, the repo
standing alone (docs/design.md section 1)."""

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_loop", "masking", "advantages")
# the library: everything but the application (agent_loop.cli, agent_loop.recipes) and the entry points (__main__)
LIBRARY = ("agent_loop.training", "agent_loop.episode", "agent_loop.tasks", "agent_loop.backends", "agent_loop.runners",
           "agent_loop.integrations", "agent_loop.tiny", "agent_loop.inspect", "agent_loop.types",
           "agent_loop.model_folders", "agent_loop.options", "agent_loop.signals", "agent_loop.proxy", "agent_loop.toolsets",
           "agent_loop.ecosystem", "agent_loop.builtin_models", "agent_loop.files", "agent_loop.threads",
           "masking", "advantages")
APPLICATION_ONLY = ("agent_loop.cli", "agent_loop.recipes", "argparse", "yaml")  # and rich, outside the inspect views


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def is_entry_point(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``: a module's ``python -m`` door into the application, as a ``__main__``."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and [getattr(c, "value", None) for c in test.comparators] == ["__main__"])


def imports(name: str, *, doors: bool = False, modules: dict[str, Path] = MODULES) -> set[str]:
    """Every module ``name`` imports, at the top or inside a function (its ``if __name__ == "__main__":`` block
    aside unless ``doors``: see :func:`is_entry_point`): ``import a.b`` is ``a.b``; ``from a import b`` is ``a``
    (its ``__init__`` runs) and also ``a.b`` when that is a module."""
    path = modules[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if doors or not is_entry_point(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    return {name: {m for m in imports(name) if m in MODULES and m != name} for name in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_an_entry_point_block_is_found():
    door = ast.parse('if __name__ == "__main__":\n    import agent_loop.cli\n').body[0]
    assert is_entry_point(door) and not is_entry_point(ast.parse("if __name__:\n    pass\n").body[0])


def test_no_import_cycles_package_init_included():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"a.b"}, "a.b": {"a"}, "c": set()}) == [["a", "a.b"]]
    edges = graph()
    edges["masking.kinds"] = edges["masking.kinds"] | {"masking.batch"}  # batch -> spans -> kinds -> batch
    assert any("masking.kinds" in c for c in cycles(edges))


def package_of(name: str) -> str:
    """The package a module belongs to: ``agent_loop.episode.loop`` -> ``agent_loop.episode``; a module at the
    root of agent_loop is its own (``agent_loop.types``); ``masking.batch`` -> ``masking``."""
    parts = name.split(".")
    if parts[0] != "agent_loop":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 and (ROOT / "agent_loop" / parts[1]).is_dir() else name


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the packages its modules import. The ``__main__`` entry points are left out: each is the
    door of ``python -m PACKAGE`` into the application (agent_loop.cli), not a part the package's code uses."""
    packages: dict[str, set[str]] = {}
    for name, imported in edges.items():
        if name.endswith("__main__"):
            continue
        packages.setdefault(package_of(name), set()).update(package_of(m) for m in imported)
    return {p: {q for q in imported if q != p and q in packages} for p, imported in packages.items()}


def test_no_package_cycles():
    """No package imports one that imports it back (issue 37: episode <-> tasks; the task contract now lives
    below the tasks, in agent_loop.episode.contracts)."""
    assert cycles(package_graph(graph())) == []


# the whole repo: the packages, and the tests, benchmarks, scripts and examples that import them
REPO_MODULES = {module_name(p): p for folder in (*PACKAGES, "tests", "benchmarks", "scripts", "examples")
                for p in (ROOT / folder).rglob("*.py")}


def repo_package_of(name: str) -> str:
    """:func:`package_of`, with each ``__main__`` module a node of its own: the ``python -m`` door, which nothing
    imports (it can close no cycle, so it is not its package's code)."""
    return name if name.endswith("__main__") else package_of(name)


def repo_package_graph() -> dict[str, set[str]]:
    """Package -> the packages it imports, over every module of the repo and every import in it: at the top,
    inside functions and inside ``if __name__ == "__main__":`` doors (issue 49: agent_loop.builtin_models's
    door imported agent_loop.cli, which a check outside the project found as cli <-> builtin_models)."""
    packages: dict[str, set[str]] = {}
    for name in REPO_MODULES:
        imported = {m for m in imports(name, doors=True, modules=REPO_MODULES) if m in REPO_MODULES}
        packages.setdefault(repo_package_of(name), set()).update(repo_package_of(m) for m in imported)
    return {p: q - {p} for p, q in packages.items()}


def test_no_package_cycles_over_the_whole_repo_doors_included():
    edges = repo_package_graph()
    assert {"agent_loop.cli", "agent_loop.builtin_models", "agent_loop.recipes", "tests", "benchmarks"} <= set(edges)
    assert cycles(edges) == []
    # the check sees a door: the one builtin_models had closes the cycle again
    edges["agent_loop.builtin_models"] = edges["agent_loop.builtin_models"] | {"agent_loop.cli"}
    assert any({"agent_loop.cli", "agent_loop.builtin_models"} <= set(c) for c in cycles(edges))


def test_the_builtin_models_build_under_the_files_lock_not_the_tiny_agent_s():
    """The built-in models' cache is written as every output is (agent_loop.files), not through the tiny
    agent's build module (issue 49)."""
    found = imports("agent_loop.builtin_models", doors=True)
    assert {"agent_loop.tiny.build.build", "agent_loop.tiny.build.build_lock"} & found == set()
    assert {"agent_loop.files.build_lock", "agent_loop.files.write_folder"} <= found


def test_the_package_cycle_finder_finds_one():
    edges = graph()
    edges["agent_loop.episode.loop"] = edges["agent_loop.episode.loop"] | {"agent_loop.tasks.registry"}  # tasks -> episode
    assert any({"agent_loop.episode", "agent_loop.tasks"} <= set(c) for c in cycles(package_graph(edges)))
    assert package_of("agent_loop.episode.loop") == "agent_loop.episode" and package_of("agent_loop.types") == "agent_loop.types"


def in_any(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if in_any(n, LIBRARY) and not n.endswith("__main__")))
def test_library_modules_do_not_import_the_application(name):
    bad = {m for m in imports(name) if in_any(m, APPLICATION_ONLY)}
    # the inspect views draw with rich; nothing else in the library prints
    if not in_any(name, ("agent_loop.inspect",)):
        bad |= {m for m in imports(name) if in_any(m, ("rich",))}
    assert bad == set(), f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if in_any(n, ("agent_loop.recipes",))
                                       and n != "agent_loop.recipes.__main__"))
def test_recipes_import_the_cli_only_from_their_main(name):
    assert not {m for m in imports(name) if in_any(m, ("agent_loop.cli",))}


@pytest.mark.parametrize("package", ["masking", "advantages"])
def test_math_packages_import_only_torch(package):
    names = {m.split(".")[0] for n in MODULES if in_any(n, (package,)) for m in imports(n)}
    third_party = names - set(sys.stdlib_module_names) - {"masking", "advantages"}
    assert third_party <= {"torch", "triton"}, third_party  # triton: the optional CUDA kernels


def test_rollout_path_imports_without_torch():
    code = ("import sys, agent_loop.episode.loop, agent_loop.runners.local, agent_loop.tasks.registry, "
            "agent_loop.cli.rollout, agent_loop.recipes.train_options; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_functions_fit_on_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_classes_hold_at_most_12_methods():
    """A class that does more is two (issue 55): every function in a class body counts (dunders, properties and
    static methods too)."""
    large = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > 12:
                    large.append(f"{name}.{node.name}: {methods} methods")
    assert large == []


def test_recipes_are_short_scripts():
    """train and warmstart read top to bottom as their docstrings' steps: at most 250 lines each (issue 55)."""
    lengths = {name: len(MODULES[name].read_text().splitlines()) for name in ("agent_loop.recipes.train",
                                                                              "agent_loop.recipes.warmstart")}
    assert all(length <= 250 for length in lengths.values()), lengths


def unexplained_imports(path: Path) -> list[int]:
    """The lines of ``path``'s imports made inside a function that give no reason: none of the block's import
    lines carries a comment, nor the line above the block, nor is it the body of a ``try`` whose handler catches
    ``ImportError`` (an optional dependency)."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    optional = {n.lineno for t in ast.walk(tree) if isinstance(t, ast.Try)
                and any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in t.handlers)
                for n in t.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in optional:
                continue
            first = node.lineno - 1  # the block's first line (0-based): consecutive import lines
            while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                first -= 1
            last = node.end_lineno - 1
            while last + 1 < len(lines) and lines[last + 1].strip().startswith(("import ", "from ")):
                last += 1
            if not (any("#" in line for line in lines[first:last + 1]) or lines[first - 1].strip().startswith("#")):
                found.append(node.lineno)
    return sorted(set(found))


def test_imports_inside_functions_say_why():
    """Modules import at their top; one that imports in a function says why in a few words: an optional
    dependency, or torch kept off the rollout path and the CLI's start (issue 55 item 4)."""
    unexplained = {name: lines for name, path in MODULES.items() if (lines := unexplained_imports(path))}
    assert unexplained == {}


def test_the_import_reason_check_finds_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import json\n\n\ndef g():\n    import csv  # stdlib, for the example\n\n\n"
                      "def h():\n    try:\n        import yaml\n    except ImportError:\n        yaml = None\n")
    assert unexplained_imports(module) == [2]


def test_every_folder_of_modules_is_a_package():
    """A folder without ``__init__.py`` imports from a checkout but is left out of the wheel."""
    folders = {p.parent for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert [str(f.relative_to(ROOT)) for f in sorted(folders) if not (f / "__init__.py").exists()] == []


def test_agent_loop_root_holds_few_modules():
    assert len(list((ROOT / "agent_loop").glob("*.py"))) <= 8


def test_tests_mirror_the_tree():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name not in ("data", "__pycache__")}
    packages = {p.name for p in (ROOT / "agent_loop").iterdir() if (p / "__init__.py").exists()}
    assert packages | {"masking", "advantages"} <= folders  # a test folder per package
    assert [p.name for p in (ROOT / "tests").glob("test_*.py")] == ["test_layering.py"]


def test_nothing_reads_the_folder_beside_the_repo():
    needles = ('"shared"', "../shared")
    offenders = [str(p.relative_to(ROOT)) for folder in (*PACKAGES, "tests", "benchmarks", "examples", "scripts")
                 for p in (ROOT / folder).rglob("*.py")
                 if p != Path(__file__).resolve() and any(n in p.read_text() for n in needles)]
    assert offenders == []


def declares_options(node: ast.ClassDef) -> bool:
    """A class whose body declares an option (``name: Annotated[..., Field(...)]``, or the declaration helpers
    ``integer(...)``, ``number(...)``, ``_int(...)``), or that changes inherited defaults (``override_defaults``)."""
    helpers = {"Field", "integer", "number", "_int"}

    def calls(tree) -> set[str]:
        return {getattr(n.func, "id", getattr(n.func, "attr", None)) for n in ast.walk(tree) if isinstance(n, ast.Call)}

    return (any(isinstance(s, ast.AnnAssign) and calls(s.annotation) & helpers for s in node.body)
            or any("override_defaults" in ast.unparse(d) for d in node.decorator_list))


def option_classes() -> dict[str, type]:
    """Every option class in the packages, found by reading the source (so a new one cannot be left out)."""
    found = {}
    for name, path in sorted(MODULES.items()):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and declares_options(node):
                found[f"{name}.{node.name}"] = getattr(importlib.import_module(name), node.name)
    return found


def declared_by(cls) -> set[str]:
    """The options ``cls`` declares itself: its own annotated fields, less old names (InitVars), class
    constants and inherited fields it only gives another default (``override_defaults``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return {n for n in cls.__dict__.get("__annotations__", {}) if n in fields} - set(
        cls.__dict__.get("__overridden_defaults__", {}))


def declared_twice(classes: dict[str, type]) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for qualified, cls in classes.items():
        for name in declared_by(cls):
            where.setdefault(name, []).append(qualified)
    return {name: sorted(owners) for name, owners in where.items() if len(owners) > 1}


def test_no_option_is_declared_by_two_option_classes():
    """Every option class (not only the composed ones): an option shared by two commands, or by a command and
    our verl AgentLoop, is one declaration they both inherit (issue 49: allow_config_change, estimator, resume
    in rollout, train and warmstart; seed and task in VerlLoopOptions)."""
    classes = option_classes()
    assert all(dataclasses.is_dataclass(c) for c in classes.values())
    names = {q.rpartition(".")[2] for q in classes}
    assert {"RolloutOptions", "TrainRun", "PPOOptions", "WarmstartConfig", "VerlLoopOptions", "ModelOptions", "LoopConfig",
            "TaskSourceOptions", "ServerOptions", "ThreadOptions", "AgentOptions", "OptimizerOptions"} <= names
    assert declared_twice(classes) == {}


def test_the_option_check_finds_one_declared_twice():
    @dataclasses.dataclass
    class Mine:
        seed: int = 0

    classes = {**option_classes(), "here.Mine": Mine}
    assert declared_twice(classes) == {"seed": ["agent_loop.tasks.registry.SeedOptions", "here.Mine"]}
    from agent_loop.options import override_defaults

    @override_defaults("another default", seed=1)
    class Other(Mine):
        pass

    assert declared_by(Other) == set()  # a changed default is no declaration
