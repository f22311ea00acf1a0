"""Warnings under the CLI are one line each, as errors are (issue 40 item 8): ``PROG: warning: ...``, without
Python's internal ``.../file.py:550: UserWarning:`` prefix and the source line it prints after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

from agent_loop.cli.stops import run_command

SCRIPT = textwrap.dedent("""
    import warnings
    from types import SimpleNamespace

    from agent_loop.cli.stops import run_command
    from agent_loop.tasks.dataset import DatasetTask

    def command(args):
        DatasetTask([{"prompt": "a", "answer": 1}, {"nope": 1}], reward="exact")  # the bad-rows warning
        warnings.warn("a library's\\nnotice", FutureWarning)
        return 0

    raise SystemExit(run_command("agent-loop rollout", SimpleNamespace(run=command)))
""")


def test_warnings_print_one_line_each_with_no_internal_path_or_source_line():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines == ["agent-loop rollout: warning: 1 bad prompt row skipped (1 kept): prompts[1]: no 'prompt' field "
                     "(keys: nope)",
                     "agent-loop rollout: warning (FutureWarning): a library's notice"], done.stderr
    assert "dataset.py" not in done.stderr and "DatasetTask(" not in done.stderr


def test_the_default_format_is_back_after_the_command_and_recorders_still_see_warnings():
    default = warnings.formatwarning

    def command(args):
        assert warnings.formatwarning is not default
        warnings.warn("seen by the recorder")
        return 0

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert run_command("agent-loop x", SimpleNamespace(run=command)) == 0
    assert [str(w.message) for w in seen] == ["seen by the recorder"]
    assert warnings.formatwarning is default
