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

The package is a thin layer over the compiled ``torch_pipeline._C`` (pipelines, events, worker
threads; see ``_C.pyi``) with small modules for the rest: ``_tasks`` (TaskFuture), ``_decorators``
(``pipelined``), ``_collectives`` (``collective``, ``comm_stream``), ``_tracking`` (``track``,
``tracking_stats``), ``_exit`` (the interpreter-exit drain). Importing it changes nothing in torch.
``python -m torch_pipeline`` prints what is installed and what it sees (for bug reports).
"""
from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (loads the libraries _C links against)

from ._guard import load_extension

load_extension()  # an ImportError that says what to do when _C is missing or mismatched
from . import _C as _C  # the compiled module, loaded above
from . import (
    _compiled,  # noqa: F401  (tracks torch.compile's regions as ops)
    _exit,  # noqa: F401  (registers the interpreter-exit handler)
    _graphs,  # noqa: F401  (graph capture: hooks installed at the first Pipeline)
)
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
from ._collectives import collective, comm_stream
from ._decorators import pipelined
from ._overlap import carry, item_async, offload, prefetch
from ._tasks import TaskFuture
from ._tracking import track, tracking_stats
from ._version import __version__ as __version__

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
    "carry",
    "collective",
    "comm_stream",
    "item_async",
    "offload",
    "prefetch",
    "synchronize",
    "track",
    "tracking_stats",
]


def __getattr__(name: str) -> Any:
    # tp.distributed, imported on first use (it imports torch.distributed).
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
