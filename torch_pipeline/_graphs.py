"""Graph capture under automatic synchronization (docs/design.md §4 "Graph capture").

``torch.cuda.graph`` (and CUDA graph trees, which ``torch.compile(mode="reduce-overhead")`` uses)
capture through ``torch.cuda.CUDAGraph.capture_begin`` / ``capture_end`` and run the graph with
``replay``. Those methods are wrapped, once, when the first pipeline is created (importing
torch_pipeline changes nothing in torch), with the hooks below, which ``torch_pipeline.sim.Graph``
(the sim device's twin) calls too:

* around the begin: the tracker's device queries pause in every thread (an event query during a
  capture in CUDA's global mode fails the capture), and the capture the current stream now
  records into is registered: the ops of this thread are captured, waits between their streams
  are captured event record + wait edges, a side pipeline's stream is forked into the capture at
  its first op there;
* before the end: side pipelines whose captured work the capturing stream never waited for are
  joined back, so the capture ends cleanly; after it, polls resume and the graph object gets the
  ``_C._CapturedGraph`` that keeps what it uses alive for its lifetime;
* around a replay: one op on the replaying stream that reads and writes what the graph does, so
  the replay is ordered after the producers of its inputs on other pipelines, and their later
  readers after it.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional, TypeVar

import torch

from . import _C, _storages

__all__: List[str] = []

T = TypeVar("T")

# Where the hooks keep the _C._CapturedGraph on a graph object.
_ATTR = "_torch_pipeline_captured"
_HOOKED = "_torch_pipeline_hook"
_lock = threading.Lock()
_installed = False


def capture_begin(begin: Callable[[], T], stream: Callable[[], torch.Stream]) -> T:
    """``begin()`` (the device's capture begin) with the tracker told: ``stream()`` is the stream
    it captures on (asked after the begin)."""
    _C._capture_prepare()
    try:
        out = begin()
    except BaseException:
        _C._capture_abandoned()
        raise
    _C._capture_begun(stream())
    return out


def capture_end(graph: Any, end: Callable[[], T]) -> T:
    """``end()`` (the device's capture end) with side pipelines joined back first; attaches what
    the graph keeps to ``graph``."""
    join_error: Optional[BaseException] = None
    try:
        _C._capture_join_back()
    except Exception as e:  # (the device's end must run whatever happens: it ends the capture)
        join_error = e
    try:
        out = end()
    finally:
        captured = _C._capture_ended()  # (also when the end failed: the capture is over)
    if join_error is not None:
        raise join_error
    graph.__dict__[_ATTR] = captured
    return out


def replay(graph: Any, run: Callable[[], T]) -> T:
    """``run()`` (the device's replay) ordered like one op on the current streams."""
    captured: Optional[Any] = graph.__dict__.get(_ATTR)
    if captured is None or not _C._tracking_live():
        return run()
    scope = captured.replay()
    try:
        return run()
    finally:
        scope.close()


def reset(graph: Any, run: Callable[[], T]) -> T:
    """``run()`` (the device's reset): the graph keeps nothing alive any more."""
    captured = graph.__dict__.pop(_ATTR, None)
    if captured is not None:
        captured.reset()
    return run()


def captured(graph: Any) -> Optional[Any]:
    """The ``_C._CapturedGraph`` attached to ``graph`` (None before its capture ended, or after
    ``reset``)."""
    return graph.__dict__.get(_ATTR)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, _HOOKED, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _HOOKED, True)
    setattr(cls, name, wrapped)


def install_cuda_graph_hooks() -> None:
    """Wraps ``torch.cuda.CUDAGraph``'s capture_begin, capture_end, replay and reset (once; a
    torch without CUDA graphs is left alone)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        _installed = True
        cls = getattr(torch.cuda, "CUDAGraph", None)
        if not isinstance(cls, type):
            return

        def begin(original: Callable[..., Any]) -> Callable[..., Any]:
            def capture_begin_(self: Any, *args: Any, **kwargs: Any) -> Any:
                return capture_begin(lambda: original(self, *args, **kwargs),
                                     torch.cuda.current_stream)
            return capture_begin_

        def end(original: Callable[..., Any]) -> Callable[..., Any]:
            def capture_end_(self: Any, *args: Any, **kwargs: Any) -> Any:
                return capture_end(self, lambda: original(self, *args, **kwargs))
            return capture_end_

        def replay_(original: Callable[..., Any]) -> Callable[..., Any]:
            def replay__(self: Any, *args: Any, **kwargs: Any) -> Any:
                return replay(self, lambda: original(self, *args, **kwargs))
            return replay__

        def reset_(original: Callable[..., Any]) -> Callable[..., Any]:
            def reset__(self: Any, *args: Any, **kwargs: Any) -> Any:
                return reset(self, lambda: original(self, *args, **kwargs))
            return reset__

        _wrap(cls, "capture_begin", begin)
        _wrap(cls, "capture_end", end)
        _wrap(cls, "replay", replay_)
        _wrap(cls, "reset", reset_)


def _install_first_pipeline_hooks() -> None:
    """What the first Pipeline installs: the CUDA graph hooks and the storage resize hook."""
    install_cuda_graph_hooks()
    _storages.install_storage_hooks()


_C._set_graph_hooks_installer(_install_first_pipeline_hooks)
