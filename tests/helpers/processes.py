"""Whether a process still runs, for the tests that check what a command leaves behind."""

import psutil


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (an exited child its parent has not reaped yet); gone or unreadable: False."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
