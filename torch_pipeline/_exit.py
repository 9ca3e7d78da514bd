"""Interpreter exit: queued and running tasks are finished (like ThreadPoolExecutor)."""
from __future__ import annotations

import atexit

from . import _C

_EXIT_TIMEOUT = "TORCH_PIPELINE_EXIT_TIMEOUT"


def _exit_timeout() -> float:
    """Seconds to wait for the tasks at exit (TORCH_PIPELINE_EXIT_TIMEOUT); -1.0: no bound.
    A value that is not a number of seconds >= 0 raises ValueError naming the variable."""
    seconds = _C._env_seconds(_EXIT_TIMEOUT)
    return -1.0 if seconds is None else seconds


def _at_exit() -> None:
    """At interpreter exit: finish queued and running tasks (like ThreadPoolExecutor).

    With TORCH_PIPELINE_EXIT_TIMEOUT=seconds, or after Ctrl-C while waiting, the tasks that
    have not started are cancelled (their futures raise RuntimeError) and running ones are
    abandoned; a line on stderr says so. A bad TORCH_PIPELINE_EXIT_TIMEOUT waits for every task,
    as when unset, then raises its ValueError (Python reports it on stderr).
    """
    try:
        timeout = _exit_timeout()
    except ValueError:
        _C._shutdown(-1.0)
        raise
    try:
        _C._shutdown(timeout)
    except KeyboardInterrupt:  # Ctrl-C before the native wait began: give up waiting at once
        _C._shutdown(0.0)


atexit.register(_at_exit)
