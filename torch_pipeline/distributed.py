"""torch.distributed with pipelines: one process group per worker thread.

Collectives of one process group must be issued in the same order on every rank. Issued from two
threads of a rank concurrently, they race for the group: rank 0 may issue A then B while rank 1
issues B then A, and both wait forever (with NCCL) or pair the wrong tensors (with Gloo). The rule:

    **each thread that issues collectives uses a process group of its own.**

:func:`thread_groups` creates those groups, one per worker thread, collectively and in a fixed
order (worker thread 0, 1, ...), so that group *i* means the same thing on every rank; tasks of
worker thread *i* use group *i* (``groups.current()`` inside a task). The main thread keeps the
group it had (the default group); do not issue collectives on it from tasks.

    >>> import torch_pipeline as tp, torch_pipeline.distributed as tpd
    >>> dist.init_process_group("gloo")                 # or "nccl"; torchrun sets the rest
    >>> groups = tpd.thread_groups()                    # on every rank, same order
    >>> comm = tp.Pipeline(tp.get_worker_thread(1))
    >>> def reduce(bucket):
    ...     with tp.collective():                      # the worker thread's comm stream
    ...         dist.all_reduce(bucket, group=groups.current())
    ...     return bucket
    >>> fut = comm.submit(reduce, grads)

:func:`set_debug` (or ``TORCH_PIPELINE_DEBUG_COLLECTIVES=1``) reports a process group used from a
second thread, the pattern that deadlocks.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Union, overload

import torch.distributed as dist

from . import _C
from ._C import WorkerThread, max_worker_threads
from ._collectives import _install_work_hooks

__all__ = ["ThreadGroups", "thread_groups", "set_debug", "hazards", "clear_hazards"]


class ThreadGroups(Sequence[dist.ProcessGroup]):
    """The process groups of :func:`thread_groups`: ``groups[i]`` (or ``groups[worker_thread]``)
    is worker thread *i*'s; ``groups.current()`` is the calling thread's."""

    def __init__(self, groups: List[dist.ProcessGroup]) -> None:
        self._groups = list(groups)

    @overload
    def __getitem__(self, key: Union[int, WorkerThread]) -> dist.ProcessGroup: ...
    @overload
    def __getitem__(self, key: slice) -> List[dist.ProcessGroup]: ...

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        if isinstance(key, WorkerThread):
            key = key.id
        return self._groups[key]

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[dist.ProcessGroup]:
        return iter(self._groups)

    def current(self) -> dist.ProcessGroup:
        """The group of the calling thread's worker thread: its own inside a task, else that of
        its current pipeline (worker thread 0 for the default pipeline)."""
        return self._groups[_C._collective_worker()]

    def __repr__(self) -> str:
        return f"ThreadGroups({len(self._groups)} process groups, one per worker thread)"


def thread_groups(group: Optional[dist.ProcessGroup] = None,
                  backend: Optional[str] = None) -> ThreadGroups:
    """Creates one process group per worker thread (``tp.max_worker_threads()`` of them) over the
    ranks of ``group`` (default: the default group), with ``backend`` (default: the default
    group's). A collective call: every rank of ``group`` must call it, at the same point of its
    program; the groups are created in worker-thread order, so group *i* is the same group on
    every rank. The worker-thread cap must be the same on every rank (checked). Installs the
    c10d ``Work`` hooks of :class:`torch_pipeline.collective` (async collectives' outputs become
    ready where ``work.wait()`` ran).

        >>> groups = tpd.thread_groups()
        >>> groups[1]            # worker thread 1's process group
    """
    _install_work_hooks()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("thread_groups() needs torch.distributed initialized first "
                           "(dist.init_process_group)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    cap = max_worker_threads()
    caps: List[Optional[int]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(caps, cap, group=group)
    if any(c != cap for c in caps):
        raise RuntimeError(f"the worker-thread cap differs between ranks ({caps}): set the same "
                           "cap everywhere (tp.set_max_worker_threads or "
                           "TORCH_PIPELINE_MAX_WORKER_THREADS) before thread_groups()")
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return ThreadGroups([dist.new_group(ranks=ranks, backend=backend) for _ in range(cap)])


def set_debug(on: bool = True) -> None:
    """Debug mode: report a process group that collectives are issued on from a second thread
    (a warning, once, and :func:`hazards`). It observes every op while on."""
    _C._set_collective_debug(bool(on))


def hazards() -> List[str]:
    """What debug mode found: one line per process group used from another thread."""
    return list(_C._collective_hazards())


def clear_hazards() -> None:
    """Forgets what debug mode found (and which thread used which group)."""
    _C._clear_collective_hazards()

