"""torch_pipeline: OneFlow-style Pipelines for PyTorch.

A :class:`Pipeline` is a cross-device lane: one compute stream per accelerator device it touches,
bound to one of a capped pool of worker threads. Pipelines whose lifetimes do not overlap reuse
the same streams; live pipelines never share one (with the CUDA build). The API mirrors
``torch.cuda.Stream`` / ``torch.cuda.stream``::

    import torch_pipeline as tp

    p = tp.Pipeline()                  # bound to worker thread 0
    with tp.pipeline(p):               # like torch.cuda.stream(s), on every device p uses
        y = model(x)
    logger = tp.Pipeline(tp.get_worker_thread(1))
    fut = logger.submit(print, loss)   # runs on worker thread 1, under `logger`
    fut.wait()                         # a torch.futures.Future; waits for the task's streams too
"""
from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
from types import TracebackType
from typing import Any, Callable, Generic, Iterable, List, Optional, Type, TypeVar, Union, overload

import torch
import torch.futures

from . import _C
from ._C import (
    Pipeline,
    PipelineEvent,
    WorkerThread,
    current_pipeline,
    default_pipeline,
    get_worker_thread,
    max_worker_threads,
    pipeline,
    set_max_worker_threads,
    set_pipeline,
    synchronize,
)

__version__ = "0.1.0"

__all__ = [
    "Pipeline",
    "PipelineEvent",
    "TaskFuture",
    "WorkerThread",
    "current_pipeline",
    "default_pipeline",
    "get_worker_thread",
    "max_worker_threads",
    "pipeline",
    "pipelined",
    "set_max_worker_threads",
    "set_pipeline",
    "collective",
    "comm_stream",
    "synchronize",
    "track",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
DeviceLike = Union[torch.device, str, int, None]


# ---- automatic synchronization -------------------------------------------------------------------
TensorsLike = Union[torch.Tensor, Iterable[torch.Tensor]]


def _tensor_list(value: TensorsLike, what: str) -> List[torch.Tensor]:
    items = [value] if isinstance(value, torch.Tensor) else value
    try:
        tensors = list(items)
    except TypeError:
        raise TypeError(f"track({what}=...) expects a tensor or an iterable of tensors, got "
                        f"{type(value).__name__}") from None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"track({what}=...) expects tensors, got an element of type "
                            f"{type(t).__name__}")
    return tensors


class track:
    """Declares accesses the dispatcher never sees (kernels launched on raw data pointers, say by
    a custom extension or Triton launcher that bypasses torch ops), so that automatic
    synchronization covers them.

    On entry the current streams of the tensors' devices wait as they would before an op that reads
    ``read`` and writes ``write``; on exit the end of those accesses is recorded, so later ops on
    other pipelines wait for it. Launch the raw kernels on the current stream inside the block.
    Does nothing while no non-default pipeline is alive (nothing is tracked then).

        >>> with tp.pipeline(p), tp.track(read=[x], write=[out]):
        ...     my_ext.launch(x.data_ptr(), out.data_ptr(), torch.cuda.current_stream().cuda_stream)
    """

    def __init__(self, read: TensorsLike = (), write: TensorsLike = ()) -> None:
        self._reads = _tensor_list(read, "read")
        self._writes = _tensor_list(write, "write")
        self._scope: Optional[_C._TrackScope] = None

    def __enter__(self) -> "track":
        if self._scope is not None:
            raise RuntimeError("this track(...) block is already entered; make a new one")
        self._scope = _C._TrackScope(self._reads, self._writes)
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._scope = None  # records the end of the accesses


# ---- communication streams -----------------------------------------------------------------------
def __getattr__(name: str) -> Any:
    # tp.distributed, imported on first use (it imports torch.distributed).
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if os.environ.get("TORCH_PIPELINE_DEBUG_COLLECTIVES") == "1":
    _C._set_collective_debug(True)


def _hook_work_waits() -> None:
    """After ``Work.wait()`` (also ``synchronize``, ``block_current_stream``) of an async
    collective, tell automatic synchronization that its outputs are ready on the current streams
    (its kernels may have run on a stream of the process group's own). Covers ``Work`` and the
    subclasses torch registers with waits of their own."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    work_class = getattr(c10d, "Work", None)
    if work_class is None:
        return
    classes = [work_class] + [c for c in vars(c10d).values()
                              if isinstance(c, type) and c is not work_class
                              and issubclass(c, work_class)]
    for cls in classes:
        for name in ("wait", "synchronize", "block_current_stream"):
            original = cls.__dict__.get(name)
            if original is None or getattr(original, "_torch_pipeline_hook", False):
                continue

            def hooked(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                result = _original(self, *args, **kwargs)
                _C._work_waited(self)
                return result

            functools.update_wrapper(hooked, original)
            hooked._torch_pipeline_hook = True  # type: ignore[attr-defined]
            setattr(cls, name, hooked)


_hook_work_waits()


class collective:
    """Makes this thread's communication streams current: one per (worker thread, device), shared by
    every pipeline of that worker thread, never one of their compute streams. Collectives issued
    inside (``torch.distributed`` with ``async_op=False``; ProcessGroupNCCL launches those on the
    current stream since torch 2.8) run there, in the order this thread issues them, overlapping
    the pipelines' compute; automatic synchronization orders their inputs after their producers and
    their consumers after them. The thread's worker thread is its own on a worker thread (inside a
    task), else that of the current pipeline. On the CPU (Gloo) there are no streams and it changes
    nothing.

        >>> def reduce_bucket(bucket):            # a task on the comm pipeline's worker thread
        ...     with tp.collective():
        ...         dist.all_reduce(bucket, group=groups.current())
        ...     return bucket
        >>> comm.submit(reduce_bucket, grads)
    """

    def __enter__(self) -> "collective":
        if getattr(self, "_guard", None) is not None:
            raise RuntimeError("this collective() block is already entered; make a new one")
        self._guard: Optional[_C._CollectiveGuard] = _C._CollectiveGuard()
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
    d = _resolve_device(device)
    if d is None:
        return None
    return _to_torch_stream(_C._comm_stream(worker_thread, d))


# ---- devices ---------------------------------------------------------------------------------
def _resolve_device(device: DeviceLike) -> Optional[torch.device]:
    """The accelerator device meant by ``device``; None for the CPU or when there is none."""
    if device is None:
        return _C._current_accelerator_device()
    if isinstance(device, bool):
        raise TypeError("device must be a torch.device, a str, an int or None, got a bool")
    if isinstance(device, int):
        current = _C._current_accelerator_device()
        if current is None:
            raise ValueError(f"device index {device} given, but no accelerator is available")
        return torch.device(current.type, device)
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device):
        raise TypeError(
            f"device must be a torch.device, a str, an int or None, got {type(device).__name__}"
        )
    return None if device.type == "cpu" else device


def _to_torch_stream(stream: torch.Stream) -> torch.Stream:
    if torch.device(stream.device).type == "cuda":
        return torch.cuda.Stream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )
    return stream


def _stream(self: Pipeline, device: DeviceLike = None) -> Optional[torch.Stream]:
    """This pipeline's stream on ``device`` (default: the current accelerator device).

    Returns None for the CPU, or when no accelerator is available. The stream is acquired on
    first use; for the default pipeline it is the stream that was current outside any pipeline
    context on this thread. On CUDA the result is a ``torch.cuda.Stream``.

        >>> p = tp.Pipeline()
        >>> s = p.stream("cuda:0")          # doctest: +SKIP
        >>> with torch.cuda.stream(s): ...  # the same stream that `with p:` makes current
    """
    d = _resolve_device(device)
    if d is None:
        return None
    return _to_torch_stream(self._stream(d))


Pipeline.stream = _stream  # type: ignore[attr-defined]


def _elapsed_time(
    self: PipelineEvent, end_event: PipelineEvent, device: DeviceLike = None
) -> float:
    """Milliseconds from this event to ``end_event`` on ``device`` (both need enable_timing)."""
    d = _resolve_device(device)
    if d is None:
        raise ValueError("elapsed_time needs an accelerator device")
    return self._elapsed_time(end_event, d)


PipelineEvent.elapsed_time = _elapsed_time  # type: ignore[attr-defined]


# ---- tasks -----------------------------------------------------------------------------------
class TaskFuture(torch.futures.Future, Generic[T]):
    """The future of :meth:`Pipeline.submit`: a ``torch.futures.Future`` whose ``wait()``

    * can be interrupted with Ctrl-C (KeyboardInterrupt), and
    * makes the waiter's current streams wait for the task's streams, so the value (and any
      tensor the task wrote) can be used at once, on any stream.

        >>> fut = tp.Pipeline(1).submit(torch.add, a, b)
        >>> c = fut.wait()
    """

    _tp_sync: "_C._TaskSync"

    def wait(self) -> T:
        self._tp_sync.wait()
        return super().wait()


_C._set_future_class(TaskFuture)


# ---- decorators ------------------------------------------------------------------------------
def _wrap_generator(p: Optional[Pipeline], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def generator_wrapper(*args: Any, **kwargs: Any) -> Any:
        with pipeline(p):
            gen = fn(*args, **kwargs)
        try:
            with pipeline(p):
                response = gen.send(None)
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    with pipeline(p):
                        gen.close()
                    raise
                except BaseException:
                    with pipeline(p):
                        response = gen.throw(*sys.exc_info())
                else:
                    with pipeline(p):
                        response = gen.send(request)
        except StopIteration as stop:
            return stop.value

    return generator_wrapper


def _decorate(p: Optional[Pipeline], fn: F) -> F:
    """``fn`` run under pipeline ``p`` (None: unchanged behaviour). Used by ``pipeline(p)(fn)``."""
    if not callable(fn):
        raise TypeError(f"a pipeline decorator needs a callable, got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn):
        return _wrap_generator(p, fn)  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with pipeline(p):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_C._set_decorate(_decorate)


class _FromSelf:
    def __repr__(self) -> str:
        return "<self.pipeline>"


_FROM_SELF = _FromSelf()


def _decorate_method(fn: F) -> F:
    if not callable(fn):
        raise TypeError(f"@pipelined needs a callable, got {type(fn).__name__}")

    def pipeline_of(self: Any) -> Optional[Pipeline]:
        try:
            p = self.pipeline
        except AttributeError:
            raise AttributeError(
                f"@torch_pipeline.pipelined runs {fn.__qualname__} under self.pipeline, but "
                f"{type(self).__name__} has no attribute 'pipeline': set self.pipeline = "
                f"torch_pipeline.Pipeline() in __init__, or use @torch_pipeline.pipelined(p)"
            ) from None
        if p is not None and not isinstance(p, Pipeline):
            raise TypeError(
                f"{type(self).__name__}.pipeline must be a torch_pipeline.Pipeline or None, got "
                f"{type(p).__name__}"
            )
        return p

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return (yield from _wrap_generator(pipeline_of(self), fn)(self, *args, **kwargs))

        return generator_method  # type: ignore[return-value]

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with pipeline(pipeline_of(self)):
            return fn(self, *args, **kwargs)

    return method  # type: ignore[return-value]


@overload
def pipelined(fn: F) -> F: ...
@overload
def pipelined(p: Optional[Pipeline] = ...) -> Callable[[F], F]: ...


def pipelined(arg: Any = _FROM_SELF) -> Any:
    """Decorator: run a function or method under a pipeline.

    * ``@tp.pipelined`` (or ``@tp.pipelined()``) on a method, e.g. ``nn.Module.forward``: runs it
      under ``self.pipeline``.
    * ``@tp.pipelined(p)``: runs the function under ``p`` (``None``: no pipeline change).

        >>> class Branch(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.pipeline = tp.Pipeline()
        ...         self.lin = torch.nn.Linear(4, 4)
        ...     @tp.pipelined
        ...     def forward(self, x):
        ...         return self.lin(x)
    """
    if arg is _FROM_SELF:
        return _decorate_method
    if isinstance(arg, Pipeline) or arg is None:
        return functools.partial(_decorate, arg)
    if callable(arg):
        return _decorate_method(arg)
    raise TypeError(
        f"pipelined expects a torch_pipeline.Pipeline, None, or a function to decorate, got "
        f"{type(arg).__name__}"
    )


# ---- interpreter exit ------------------------------------------------------------------------
def _exit_timeout() -> float:
    text = os.environ.get("TORCH_PIPELINE_EXIT_TIMEOUT", "").strip()
    if not text:
        return -1.0
    try:
        value = float(text)
    except ValueError:
        print(
            f"torch_pipeline: ignoring TORCH_PIPELINE_EXIT_TIMEOUT={text!r} (not a number of "
            "seconds); waiting for all tasks",
            file=sys.stderr,
        )
        return -1.0
    return max(value, 0.0)


def _at_exit() -> None:
    """At interpreter exit: finish queued and running tasks (like ThreadPoolExecutor).

    With TORCH_PIPELINE_EXIT_TIMEOUT=seconds, or after Ctrl-C while waiting, the tasks that
    have not started are cancelled (their futures raise RuntimeError) and running ones are
    abandoned; a line on stderr says so.
    """
    try:
        _C._shutdown(_exit_timeout())
    except KeyboardInterrupt:  # Ctrl-C before the native wait began: give up waiting at once
        _C._shutdown(0.0)


atexit.register(_at_exit)
