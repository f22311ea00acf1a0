"""The architecture as rules: which package may import what, no import cycles, short functions, the repo
standing alone (docs/design.md section 1)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_loop", "masking", "advantages", "trainer")
# the library: everything but the application (agent_loop.cli), the trainer and the entry points (__main__)
LIBRARY = ("agent_loop.episode", "agent_loop.tasks", "agent_loop.backends", "agent_loop.runners",
           "agent_loop.integrations", "agent_loop.tiny", "agent_loop.inspect", "agent_loop.types",
           "agent_loop.models", "agent_loop.config", "agent_loop.signals", "agent_loop.proxy", "agent_loop.toolsets",
           "agent_loop.ecosystem", "agent_loop.model_registry", "agent_loop.files", "agent_loop.threads",
           "masking", "advantages")
APPLICATION_ONLY = ("agent_loop.cli", "trainer", "argparse", "yaml")  # and rich, outside the inspect views


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def is_entry_point(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``: a module's ``python -m`` door into the application, as a ``__main__``."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and [getattr(c, "value", None) for c in test.comparators] == ["__main__"])


def imports(name: str) -> set[str]:
    """Every module ``name`` imports, at the top or inside a function (its ``if __name__ == "__main__":`` block
    aside: see :func:`is_entry_point`): ``import a.b`` is ``a.b``; ``from a import b`` is ``a`` (its ``__init__``
    runs) and also ``a.b`` when that is a module."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not is_entry_point(node)]
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


def test_an_entry_point_block_is_not_the_module_s_imports():
    """agent_loop.model_registry's ``python -m`` door imports agent_loop.cli.models, which imports it back."""
    assert "agent_loop.cli.models" not in imports("agent_loop.model_registry")
    assert "agent_loop.model_registry" in imports("agent_loop.cli.models")
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


def test_the_package_cycle_finder_finds_one():
    edges = graph()
    edges["agent_loop.episode.loop"] = edges["agent_loop.episode.loop"] | {"agent_loop.tasks.base"}
    edges["agent_loop.tasks.base"] = edges["agent_loop.tasks.base"] | {"agent_loop.episode.tools"}
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


@pytest.mark.parametrize("name", sorted(n for n in MODULES if in_any(n, ("trainer",)) and n != "trainer.__main__"))
def test_trainer_imports_the_cli_only_from_its_main(name):
    assert not {m for m in imports(name) if in_any(m, ("agent_loop.cli",))}


@pytest.mark.parametrize("package", ["masking", "advantages"])
def test_math_packages_import_only_torch(package):
    names = {m.split(".")[0] for n in MODULES if in_any(n, (package,)) for m in imports(n)}
    third_party = names - set(sys.stdlib_module_names) - {"masking", "advantages"}
    assert third_party <= {"torch", "triton"}, third_party  # triton: the optional CUDA kernels


def test_rollout_path_imports_without_torch():
    code = ("import sys, agent_loop.episode.loop, agent_loop.runners.local, agent_loop.tasks.registry, "
            "agent_loop.cli.rollout, trainer.config; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_functions_fit_on_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_every_folder_of_modules_is_a_package():
    """A folder without ``__init__.py`` imports from a checkout but is left out of the wheel."""
    folders = {p.parent for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert [str(f.relative_to(ROOT)) for f in sorted(folders) if not (f / "__init__.py").exists()] == []


def test_agent_loop_root_holds_few_modules():
    assert len(list((ROOT / "agent_loop").glob("*.py"))) <= 8


def test_tests_mirror_the_tree():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name not in ("data", "__pycache__")}
    packages = {p.name for p in (ROOT / "agent_loop").iterdir() if (p / "__init__.py").exists()}
    assert packages | {"masking", "advantages", "trainer"} <= folders  # a test folder per package
    assert [p.name for p in (ROOT / "tests").glob("test_*.py")] == ["test_layering.py"]


def test_nothing_reads_the_folder_beside_the_repo():
    needles = ('"shared"', "../shared")
    offenders = [str(p.relative_to(ROOT)) for folder in (*PACKAGES, "tests", "benchmarks", "examples", "scripts")
                 for p in (ROOT / folder).rglob("*.py")
                 if p != Path(__file__).resolve() and any(n in p.read_text() for n in needles)]
    assert offenders == []
