"""``@once``: a function of no arguments that runs at most once per process, however many threads
call it (the hooks the first Pipeline installs into torch)."""
from __future__ import annotations

import functools
import threading
from typing import Callable


def once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` wrapped to run on its first call only; later and concurrent calls return at once
    (a concurrent one after the first has finished). A first call that raises counts as run.

    Example::

        @once
        def install() -> None:
            torch.Tensor.foo = foo
    """
    lock = threading.Lock()
    done = False

    @functools.wraps(fn)
    def wrapper() -> None:
        nonlocal done
        if done:
            return
        with lock:
            if done:
                return
            done = True
            fn()

    return wrapper
