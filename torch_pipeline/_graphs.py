"""Graph capture under automatic synchronization (docs/design.md, "Graph capture").

``torch.cuda.graph`` (and CUDA graph trees, which ``torch.compile(mode="reduce-overhead")`` uses)
capture through ``torch.cuda.CUDAGraph.capture_begin`` / ``capture_end`` and run the graph with
``replay``; ``torch.accelerator.Graph`` has the same methods. Those methods are wrapped
(:func:`install_graph_hooks`), once, when the first pipeline is created (importing
torch_pipeline changes nothing in torch), with the hooks below, which ``torch_pipeline.sim.Graph``
(the sim device's twin) calls too:

* around the begin: the tracker's device queries pause in every thread (an event query during a
  capture in CUDA's global mode fails the capture), and the capture the current stream now
  records into is registered; its handle is kept on the graph object until the end, which may
  come from another thread. The ops launched on the capture's streams are captured, waits between
  them are captured event record + wait edges, a side pipeline's stream is forked into the
  capture before its first op there;
* before the end: side pipelines whose captured work the capturing stream never waited for are
  joined back, so the capture ends cleanly; after it, polls resume and the graph object gets the
  ``_C._CapturedGraph`` that keeps what it uses alive for its lifetime (an error in tracking
  inside the capture is raised here);
* around a replay: one op on the replaying stream that reads and writes what the graph does, so
  the replay is ordered after the producers of its inputs on other pipelines, and their later
  readers after it.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, List, Optional, TypeVar

import torch

from . import _C, _storages, _threads
from ._once import once

__all__: List[str] = []

T = TypeVar("T")

# Where the hooks keep, on a graph object, the _C._CapturedGraph and (while its capture is
# underway) the _C._CaptureHandle.
_ATTR = "_torch_pipeline_captured"
_CAPTURE = "_torch_pipeline_capture"
_HOOKED = "_torch_pipeline_hook"
_unordered_warned = False


def capture_begin(graph: Any, begin: Callable[[], T], stream: Callable[[], torch.Stream]) -> T:
    """``begin()`` (the device's capture begin) with the tracker told: ``stream()`` is the stream
    it captures on (the current stream). If the tracker fails after the device began (it cannot
    register the capture), the error is raised and the device's capture is left as the begin made
    it; the tracker holds no pause either way."""
    capturing = stream()
    _C._capture_prepare(capturing)
    try:
        out = begin()
    except BaseException:
        _C._capture_abandoned()
        raise
    try:
        handle = _C._capture_begun(capturing)
    except BaseException:
        _C._capture_abandoned()  # (idempotent: the prepare's pause is gone already)
        raise
    if handle is not None:
        graph.__dict__[_CAPTURE] = handle
    return out


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # (Python 3.11+)
    if add_note is not None:
        add_note(note)


def capture_end(graph: Any, end: Callable[[], T]) -> T:
    """``end()`` (the device's capture end) with side pipelines joined back first; attaches what
    the graph keeps to ``graph``. Works on any thread (the capture's handle is on ``graph``)."""
    handle = graph.__dict__.pop(_CAPTURE, None)
    join_error: Optional[BaseException] = None
    try:
        _C._capture_join_back(handle)
    except Exception as e:  # (the device's end must run whatever happens: it ends the capture)
        join_error = e
    try:
        out = end()
    except BaseException as device_error:
        try:
            _C._capture_ended(handle)  # (the capture is over: polls resume)
        except Exception as tracker_error:
            _add_note(device_error, f"torch_pipeline: {tracker_error}")
        raise
    captured = _C._capture_ended(handle)  # raises when tracking failed inside the capture
    if join_error is not None:
        raise join_error
    if captured is None:
        graph.__dict__.pop(_ATTR, None)
    else:
        graph.__dict__[_ATTR] = captured
    return out


def _warn_unordered() -> None:
    global _unordered_warned
    if _unordered_warned:
        return
    _unordered_warned = True
    warnings.warn(
        "torch_pipeline: a graph whose capture the tracker did not see (captured before the "
        "first pipeline was created) is replayed while automatic synchronization is live: the "
        "replay is not ordered against the work of other pipelines. Capture the graph again "
        "after creating a pipeline, or order the replay yourself (wait for its inputs' "
        "producers before it, and make later users of its outputs wait for it). Warned once.",
        stacklevel=3,
    )


def replay(graph: Any, run: Callable[[], T]) -> T:
    """``run()`` (the device's replay) ordered like one op on the current streams."""
    captured: Optional[Any] = graph.__dict__.get(_ATTR)
    if not _C._tracking_live():
        return run()
    if captured is None:
        _warn_unordered()
        return run()
    scope = captured.replay()
    try:
        return run()
    finally:
        scope.close()


def reset(graph: Any, run: Callable[[], T]) -> T:
    """``run()`` (the device's reset); once it succeeded, the graph keeps nothing alive any
    more."""
    out = run()
    captured = graph.__dict__.pop(_ATTR, None)
    if captured is not None:
        captured.reset()
    return out


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


def install_graph_hooks(cls: type, current_stream: Callable[[], torch.Stream]) -> None:
    """Wraps the capture_begin, capture_end, replay and reset methods of the graph class ``cls``
    (those defined in it) with the hooks above; ``current_stream()`` names the stream a capture
    begins on. Where ``cls`` has ``capture_end_pre`` (torch 2.14's CUDAGraph: the device's end,
    which ``capture_end`` calls), that is wrapped instead of ``capture_end``. Idempotent."""

    def begin(original: Callable[..., Any]) -> Callable[..., Any]:
        def capture_begin_(self: Any, *args: Any, **kwargs: Any) -> Any:
            return capture_begin(self, lambda: original(self, *args, **kwargs), current_stream)
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
    _wrap(cls, "capture_end_pre" if "capture_end_pre" in cls.__dict__ else "capture_end", end)
    _wrap(cls, "replay", replay_)
    _wrap(cls, "reset", reset_)


@once
def install_cuda_graph_hooks() -> None:
    """Wraps ``torch.cuda.CUDAGraph`` and ``torch.accelerator.Graph`` (where they exist) with
    :func:`install_graph_hooks` (once; a torch without them is left alone)."""
    cuda_graph = getattr(torch.cuda, "CUDAGraph", None)
    if isinstance(cuda_graph, type):
        install_graph_hooks(cuda_graph, torch.cuda.current_stream)
    accelerator = getattr(torch, "accelerator", None)
    accelerator_graph = getattr(accelerator, "Graph", None)
    if isinstance(accelerator_graph, type):
        install_graph_hooks(accelerator_graph, torch.accelerator.current_stream)


def _install_first_pipeline_hooks() -> None:
    """What the first Pipeline installs: the CUDA graph hooks, the storage resize hook and the
    thread start hook."""
    install_cuda_graph_hooks()
    _storages.install_storage_hooks()
    _threads.install_thread_hook()


_C._set_graph_hooks_installer(_install_first_pipeline_hooks)
