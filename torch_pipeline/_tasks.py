"""TaskFuture: what Pipeline.submit returns."""
from __future__ import annotations

from typing import Generic, TypeVar

import torch.futures

from . import _C

__all__ = ["TaskFuture"]

T = TypeVar("T")


class TaskFuture(torch.futures.Future, Generic[T]):
    """The future of :meth:`Pipeline.submit`: a ``torch.futures.Future`` whose ``wait()``

    * can be interrupted with Ctrl-C (KeyboardInterrupt), and
    * makes the waiter's current streams wait for the task's streams, so the value (and any
      tensor the task wrote) can be used at once, on any stream.

    The value may be any Python object (a generator, a lambda, a Pipeline, tensors in containers):
    it is not pickled or inspected.

        >>> fut = tp.Pipeline(1).submit(torch.add, a, b)
        >>> c = fut.wait()
    """

    _tp_sync: "_C._TaskSync"

    def wait(self) -> T:
        self._tp_sync.wait()
        return super().wait()

    def value(self) -> T:
        """The task's result (or its exception, raised) once it has finished; RuntimeError
        before that (``torch.futures.Future.value`` would fail an internal assert there)."""
        if not self.done():
            raise RuntimeError(
                "TaskFuture.value() was called before the task finished: value() never waits. "
                "Call wait() (it waits for the task, then orders this thread's streams after the "
                "task's), or check done() first"
            )
        return super().value()


_C._set_future_class(TaskFuture)
