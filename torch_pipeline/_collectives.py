"""Communication streams: ``tp.collective()``, ``tp.comm_stream()``, and the c10d ``Work`` hooks.

The hooks (after ``Work.wait()``, ``synchronize()``, ``block_current_stream()`` of an async
collective, tell automatic synchronization that its outputs are ready on the current streams) are
installed when first needed, never at import: on the first ``collective()``, the first
``torch_pipeline.distributed.thread_groups()``, or the first Pipeline created or task submitted
while ``torch.distributed.is_initialized()``. A program that only imports torch_pipeline runs
torch unchanged.
"""
from __future__ import annotations

import functools
import sys
import threading
from types import TracebackType
from typing import Any, Optional, Type, Union

import torch

from . import _C
from ._C import WorkerThread

__all__ = ["collective", "comm_stream"]

DeviceLike = Union[torch.device, str, int, None]

_HOOKED = "_torch_pipeline_hook"
_hooks_lock = threading.Lock()
_hooks_installed = False


def _install_work_hooks() -> None:
    """Wraps ``wait``, ``synchronize`` and ``block_current_stream`` of c10d's ``Work`` and of the
    subclasses torch registers with waits of their own (once; later calls do nothing)."""
    global _hooks_installed
    if _hooks_installed:
        return
    with _hooks_lock:
        if _hooks_installed:
            return
        c10d = getattr(torch._C, "_distributed_c10d", None)
        work_class = getattr(c10d, "Work", None)
        if work_class is not None:
            classes = [work_class] + [c for c in vars(c10d).values()
                                      if isinstance(c, type) and c is not work_class
                                      and issubclass(c, work_class)]
            for cls in classes:
                for name in ("wait", "synchronize", "block_current_stream"):
                    original = cls.__dict__.get(name)
                    if original is None or getattr(original, _HOOKED, False):
                        continue
                    setattr(cls, name, _hooked(original))
        _hooks_installed = True


def _hooked(original: Any) -> Any:
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _C._work_waited(self)
        return result

    functools.update_wrapper(hooked, original)
    setattr(hooked, _HOOKED, True)
    return hooked


def _install_work_hooks_if_distributed() -> bool:
    """Called by the compiled module on Pipeline creation and submit until it returns True:
    installs the hooks once torch.distributed is initialized."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    _install_work_hooks()
    return True


_C._set_work_hooks_installer(_install_work_hooks_if_distributed)

# TORCH_PIPELINE_DEBUG_COLLECTIVES=1: debug mode (torch_pipeline.distributed.set_debug) from the
# start; ValueError naming the variable for a value other than 0/1 (false/true, off/on).
if _C._env_flag("TORCH_PIPELINE_DEBUG_COLLECTIVES", False):
    _C._set_collective_debug(True)


class collective:
    """Makes this thread's communication streams current: one per (worker thread, device), shared by
    every pipeline of that worker thread, never one of their compute streams. Collectives issued
    inside (``torch.distributed`` with ``async_op=False``; ProcessGroupNCCL launches those on the
    current stream since torch 2.8) run there, in the order this thread issues them, overlapping
    the pipelines' compute; automatic synchronization orders their inputs after their producers and
    their consumers after them (also the outputs of ``async_op=True`` collectives, once their
    ``Work.wait()`` has run). The thread's worker thread is its own on a worker thread (inside a
    task), else that of the current pipeline. On the CPU (Gloo) there are no streams and it changes
    nothing.

        >>> def reduce_bucket(bucket):            # a task on the comm pipeline's worker thread
        ...     with tp.collective():
        ...         dist.all_reduce(bucket, group=groups.current())
        ...     return bucket
        >>> comm.submit(reduce_bucket, grads)
    """

    def __init__(self) -> None:
        _install_work_hooks()
        self._guard: Optional[_C._CollectiveGuard] = None

    def __enter__(self) -> "collective":
        if self._guard is not None:
            raise RuntimeError("this collective() block is already entered; make a new one")
        self._guard = _C._CollectiveGuard()
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._guard = None  # restores the streams


def comm_stream(device: DeviceLike = None,
                worker_thread: Union[WorkerThread, int, None] = None) -> Optional[torch.Stream]:
    """The communication stream of ``worker_thread`` (default: this thread's, see
    :class:`collective`) on ``device`` (default: the current accelerator device), as a
    ``torch.Stream`` (``torch.cuda.Stream`` on CUDA); None on the CPU. Created on first use.

        >>> s = tp.comm_stream("cuda:0", worker_thread=1)   # doctest: +SKIP
    """
    if worker_thread is not None and not isinstance(worker_thread, WorkerThread):
        # Checked here, also on the CPU where there is no stream to return.
        if not isinstance(worker_thread, int) or isinstance(worker_thread, bool):
            raise TypeError(
                f"worker_thread must be a torch_pipeline.WorkerThread, an int or None, got an "
                f"object of type {type(worker_thread).__name__}"
            )
        cap = _C.max_worker_threads()
        if not 0 <= worker_thread < cap:
            raise ValueError(
                f"worker thread id {worker_thread} is out of range: the cap is {cap} worker "
                f"threads (ids 0..{cap - 1})"
            )
    return _C._comm_stream(device, worker_thread)
