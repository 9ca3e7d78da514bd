"""Python threads started while automatic synchronization is live are observed from their start.

The tracker's default observer is a dispatcher fallback on a thread-local key
(``docs/design.md``, "What observing costs"): a thread's ops are observed only while it carries
the key. When tracking goes live, every Python thread takes it at its next Python call
(``csrc/python/threads.cpp``); a thread started later takes it here, before its target runs. The
wrap of ``threading.Thread._bootstrap_inner`` is installed with the first Pipeline, like the CUDA
graph hooks (importing torch_pipeline changes nothing in Python or torch); it covers
``threading.Thread`` and everything built on it (``concurrent.futures``, ``socketserver``).

Example::

    import threading, torch_pipeline as tp

    p = tp.Pipeline()                  # tracking is live from here
    t = threading.Thread(target=work)  # work's ops are observed from its first one
    t.start()
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from . import _C
from ._once import once

_HOOKED = "_torch_pipeline_hooked"


@once
def install_thread_hook() -> None:
    """Wraps ``threading.Thread._bootstrap_inner`` (once)."""
    original = getattr(threading.Thread, "_bootstrap_inner", None)
    if original is None or getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def _bootstrap_inner(self: threading.Thread) -> Any:
        _C._observe_this_thread()  # (a no-op while tracking is idle)
        return original(self)

    setattr(_bootstrap_inner, _HOOKED, True)
    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
