"""The vLLM server processes the fault tests kill (tests/runners/test_faults.py, tests/training/test_async_faults.py),
and what a vLLM run's stderr may hold when its workers are stopped."""

import re


def server_pid(url: str) -> int:
    import psutil

    port = url.rsplit(":", 1)[1]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmdline and port in cmdline:
            return process.pid
    raise LookupError(f"no vLLM server process for {url}")


# A vLLM worker's SIGTERM handler raises SystemExit wherever the worker happens to be; when that is inside a
# finalizer (`__del__`), Python prints "Exception ignored in: ..." with a traceback and goes on exiting. That
# is the worker exiting as asked, not a crash; any other traceback in the command's stderr is one.
IGNORED_EXIT_IN_FINALIZER = re.compile(
    r"Exception ignored in: [^\n]*\nTraceback \(most recent call last\):\n(?:(?:[ \t][^\n]*)?\n)*SystemExit\b[^\n]*")


def crash_tracebacks(stderr: str) -> str:
    """`stderr` without the tracebacks Python printed and ignored for a worker's SystemExit in a finalizer."""
    return IGNORED_EXIT_IN_FINALIZER.sub("", stderr)
