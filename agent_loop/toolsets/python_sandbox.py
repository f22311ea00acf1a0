"""A sandboxed ``python(code: str) -> str`` tool (``--tools python``, ``--tools python_persistent``).

Each call runs the model's code in a fresh interpreter process (``python``), or in one interpreter kept for
the episode's calls (``python_persistent``: variables carry over between calls of one episode, never to
another episode). What the code prints (stdout and stderr, in order) is the observation; a last expression's
value is printed as in a notebook. The process:

- has hard limits on CPU time, address space, file size and process count (``resource.setrlimit``, set by
  the interpreter on itself before it reads any code: ``preexec_fn`` is unsafe in a process with threads,
  and the loop runs sync tools on threads), and a wall-clock timeout after which its process group is killed;
- runs under bubblewrap where it is installed (``apt-get install bubblewrap``): new user, PID, network,
  IPC and UTS namespaces (no network, not even the host's loopback), only the interpreter's folders
  mounted read-only, an empty size-capped tmpfs as working folder (nothing written reaches the host's
  disk), no environment variables; without bubblewrap, ``unshare`` gives the network and PID namespaces
  and a fresh temporary folder on the host (files elsewhere stay readable); without either, the tool set
  refuses to load unless ``isolation="none"`` is asked for in code (:func:`isolation` says which is used);
- has its output cut at ``output_bytes`` (the rest is read and dropped, so a flood cannot block it).

A limit that ends the code (timeout, CPU time, the process killed or exiting) is an error observation; an
exception in the code is its traceback, printed as the code's own output.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

SANDBOX_DIR = "/sandbox"  # the working folder as the code sees it under bubblewrap
ISOLATIONS = ("bwrap", "unshare", "none")


class SandboxError(RuntimeError):
    """The code was stopped by a limit of the sandbox (the observation says which)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one interpreter may use. In a persistent interpreter, ``cpu_s`` is for the whole episode."""

    timeout_s: float = 8.0  # wall clock, per call (below the loop's default tool_timeout_s, so this message wins)
    cpu_s: int = 10
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file it may write
    folder_mb: int = 64  # its working folder (bubblewrap's tmpfs)
    processes: int = 32  # processes and threads of the sandbox's user
    output_bytes: int = 16384


# The interpreter inside the sandbox: limits itself, then runs each request (a length line, then the code)
# in one namespace and ends each answer with a marker line. Requests come on a copy of stdin; the code's
# own stdin is /dev/null.
RUNNER = r"""
import ast, os, resource, sys, traceback
def limit(cpu, memory, fsize, nproc):
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
    for which, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NPROC, nproc)):
        resource.setrlimit(which, (value, value))
def run(code, namespace):
    try:
        tree = ast.parse(code, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as stop:
        if stop.code not in (None, 0):
            print(f"SystemExit: {stop.code}", file=sys.stderr)
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
def main():
    marker = sys.argv[1].encode()
    limit(*map(int, sys.argv[2:6]))
    requests = os.fdopen(os.dup(0), "rb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    while header := requests.readline():
        run(requests.read(int(header)).decode("utf-8", "replace"), namespace)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, b"\n" + marker + b"\n")
main()
"""


def _runs(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def isolation() -> str:
    """The strongest isolation this machine allows: "bwrap" (bubblewrap runs here), "unshare" (user
    namespaces: network and PID namespaces only), else "none". Probed once per process."""
    if shutil.which("bwrap") and _runs(_bwrap_prefix(SandboxLimits()) + [_interpreter(), "-c", "pass"]):
        return "bwrap"
    if shutil.which("unshare") and _runs(_unshare_prefix() + ["true"]):
        return "unshare"
    return "none"


def _interpreter() -> str:
    return sys.executable


def _read_only_roots() -> list[str]:
    """The folders the interpreter needs: the system's /usr, its base install and its environment."""
    roots = {"/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return sorted(r for r in roots if os.path.isdir(r))


# the code's environment: no variables of the host; one thread per numeric library (threads count as processes)
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_UIDS = itertools.count()


def _sandbox_uid() -> int:
    """A user id of its own per sandbox (when run as root): the process-count limit is counted per user, and
    the kernel never applies it to root (even to root mapped into a user namespace)."""
    return 200_000 + (os.getpid() * 7919 + next(_UIDS)) % 100_000


def _drop_root() -> list[str]:
    if os.geteuid() != 0:
        return []
    uid = _sandbox_uid()
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _bwrap_prefix(limits: SandboxLimits) -> list[str]:
    # as root: the namespaces without a user namespace (root makes them itself), then setpriv drops to a
    # user of its own inside; otherwise a user namespace too, as the caller's (non-root) user
    command = ["bwrap", "--die-with-parent", "--clearenv"]
    command += (["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
                if os.geteuid() == 0 else ["--unshare-all"])
    for name, value in {**SANDBOX_ENV, "HOME": SANDBOX_DIR}.items():
        command += ["--setenv", name, value]
    # the empty /tmp first: a checkout (and its interpreter) under /tmp is bound into it, not hidden by it
    command += ["--tmpfs", "/tmp"]
    roots = _read_only_roots()
    for folder in sorted({parent for root in roots for parent in _parents(root)} - {"/tmp"}):
        command += ["--perms", "0755", "--dir", folder]  # traversable by the sandbox's user (/root is 0700)
    for root in roots:
        command += ["--ro-bind", root, root]
    for link in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
        if os.path.islink(f"/{link}"):
            command += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
    command += ["--proc", "/proc", "--dev", "/dev", "--chmod", "1777", "/tmp",
                "--size", str(limits.folder_mb << 20), "--tmpfs", SANDBOX_DIR, "--chmod", "1777", SANDBOX_DIR,
                "--chdir", SANDBOX_DIR]
    return command + _drop_root()


def _unshare_prefix() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child"]


def sandbox_command(limits: SandboxLimits, marker: str, how: str) -> list[str]:
    """The command line of one sandboxed interpreter (``how``: one of :data:`ISOLATIONS`)."""
    prefix = {"bwrap": lambda: _bwrap_prefix(limits), "unshare": _unshare_prefix, "none": list}[how]()
    numbers = [limits.cpu_s, limits.memory_mb << 20, limits.file_mb << 20, limits.processes]
    return prefix + [_interpreter(), "-I", "-c", RUNNER, marker, *map(str, numbers)]


class _Output:
    """What the code printed, kept up to ``cap`` bytes; the rest is counted and dropped."""

    def __init__(self, cap: int):
        self.cap, self.kept, self.total = cap, bytearray(), 0

    def take(self, data: bytes) -> None:
        self.total += len(data)
        self.kept += data[: max(0, self.cap - len(self.kept))]

    def text(self) -> str:
        text = self.kept.decode("utf-8", "replace")
        if self.total > self.cap:
            text += f"\n[output cut: {self.total} bytes printed, the first {self.cap} shown]"
        return text


async def _read_answer(stdout: asyncio.StreamReader, sentinel: bytes, output: _Output) -> bool:
    """Read the code's output up to ``sentinel`` into ``output``; False if the process ended first."""
    while True:
        try:
            output.take((await stdout.readuntil(sentinel))[: -len(sentinel)])
            return True
        except asyncio.LimitOverrunError as over:  # no sentinel in the buffer yet: take what is safe
            output.take(await stdout.readexactly(over.consumed))
        except asyncio.IncompleteReadError as ended:
            output.take(ended.partial)
            return False


def _why_ended(returncode: int | None, limits: SandboxLimits) -> str:
    signals = {signal.SIGXCPU: f"it used up its CPU-time limit of {limits.cpu_s} s",
               signal.SIGKILL: "it was killed (out of memory, or a limit)",
               signal.SIGSEGV: "it crashed (segmentation fault)"}
    # a signal that ended the interpreter: -N from the kernel, or 128 + N from bubblewrap's init, which reports it
    killed_by = -returncode if returncode is not None and returncode < 0 else (
        returncode - 128 if returncode is not None and 128 < returncode < 128 + signal.NSIG else None)
    if killed_by is not None:
        return signals.get(killed_by, f"it was killed by signal {signal.Signals(killed_by).name}")
    return f"the interpreter exited with status {returncode}"


class PythonSandbox:
    """One episode's sandboxed interpreter(s): :meth:`run` executes code; :meth:`aclose` ends it all.

    ``persistent``: keep one interpreter for every call (calls run one at a time); else a fresh one per call.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, persistent: bool = False, how: str | None = None):
        self.limits, self.persistent = limits or SandboxLimits(), persistent
        self.how = how or isolation()
        self._process: asyncio.subprocess.Process | None = None
        self._folder: tempfile.TemporaryDirectory | None = None
        self._marker = ""
        self._lock = asyncio.Lock()
        self.started = 0  # interpreters started (a persistent one is restarted after a limit ended it)

    async def run(self, code: str) -> str:
        """The output of ``code``; SandboxError when a limit stopped it."""
        async with self._lock if self.persistent else contextlib.nullcontext():
            if not self.persistent:
                return await self._run_fresh(code)
            if self._process is None:
                await self._start()
            return await self._request(self._process, code, restarts=True)

    async def _run_fresh(self, code: str) -> str:
        sandbox = PythonSandbox(self.limits, how=self.how)
        try:
            await sandbox._start()
            return await sandbox._request(sandbox._process, code, restarts=False)
        finally:
            await sandbox.aclose()

    async def _start(self) -> None:
        self._marker = secrets.token_hex(16)
        folder = None
        if self.how != "bwrap":  # bubblewrap makes its own tmpfs; the others run in a host folder
            self._folder = tempfile.TemporaryDirectory(prefix="agent-loop-python-")
            folder = self._folder.name
        env = {**SANDBOX_ENV, "HOME": folder or SANDBOX_DIR}
        self._process = await asyncio.create_subprocess_exec(
            *sandbox_command(self.limits, self._marker, self.how), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=folder, env=env, start_new_session=True,
            limit=1 << 20)
        self.started += 1

    async def _request(self, process: asyncio.subprocess.Process, code: str, restarts: bool) -> str:
        data = code.encode("utf-8", "replace")
        output = _Output(self.limits.output_bytes)
        sentinel = b"\n" + self._marker.encode() + b"\n"
        try:
            process.stdin.write(b"%d\n" % len(data) + data)
            async with asyncio.timeout(self.limits.timeout_s):
                await process.stdin.drain()
                if await _read_answer(process.stdout, sentinel, output):
                    return output.text() or "(no output)"
            why = _why_ended(await process.wait(), self.limits)
        except TimeoutError:
            why = f"it ran past the wall-clock limit of {self.limits.timeout_s:g} s"
        except (BrokenPipeError, ConnectionResetError):
            why = _why_ended(await process.wait(), self.limits)
        except BaseException:  # cancelled (the loop's own tool timeout): the code must not run on
            await self.aclose()
            raise
        await self.aclose()
        lost = "; the interpreter is restarted at the next call, its variables are gone" if restarts else ""
        shown = output.text()
        raise SandboxError(f"the code was stopped: {why}{lost}" + (f"; its output:\n{shown}" if shown else ""))

    async def aclose(self) -> None:
        """Kill the interpreter's process group (and, with it, anything the code started); remove its folder."""
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            await _group_gone(process.pid)
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None


async def _group_gone(group: int, timeout_s: float = 5.0) -> None:
    """Wait until no process of ``group`` is left alive (a killed PID namespace empties in its own time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_in_group(pid, group) for pid in _pids()):
        await asyncio.sleep(0.02)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _in_group(pid: int, group: int) -> bool:
    """Whether ``pid`` is a live (not zombie) member of process group ``group``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[2]) == group


def check_isolation(how: str) -> str:
    """``how`` ("auto" or one of :data:`ISOLATIONS`) resolved on this machine; ValueError if it cannot be had."""
    found = isolation()
    if how == "auto":
        how = found
        if how == "none":
            raise ValueError("--tools python needs bubblewrap (apt-get install bubblewrap) or user namespaces "
                             "(unshare --user --net): neither works here; PythonToolset(isolation='none') runs "
                             "code with resource limits only")
    elif how not in ISOLATIONS:
        raise ValueError(f"isolation must be 'auto' or one of {', '.join(ISOLATIONS)}, got {how!r}")
    elif ISOLATIONS.index(how) < ISOLATIONS.index(found):
        raise ValueError(f"isolation {how!r} is not available here (the strongest is {found!r})")
    return how


def make_python_tool(sandbox: PythonSandbox) -> Callable:
    """The ``python`` tool of one episode, run in ``sandbox``."""

    async def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints (a last expression's value is printed too).

        Args:
            code: The Python code to run.
        """
        return await sandbox.run(code)

    python.aclose = sandbox.aclose  # the episode's end closes the interpreter (agent_loop.toolsets)
    return python


class PythonToolset:
    """The tool set of ``--tools python`` (a fresh interpreter per call) or ``python_persistent`` (one
    interpreter per episode). Picklable: interpreters start in the process that plays the episode."""

    def __init__(self, *, persistent: bool = False, limits: SandboxLimits | None = None, isolation: str = "auto"):
        self.persistent, self.limits = persistent, limits or SandboxLimits()
        self.how = check_isolation(isolation)
        self.name = "python_persistent" if persistent else "python"

    def tools(self) -> list[Callable]:
        """One episode's tools: a ``python`` tool with its own interpreter."""
        return [make_python_tool(PythonSandbox(self.limits, persistent=self.persistent, how=self.how))]
