"""The sim device's twin of CUDA graphs (``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``).

A capture on a sim stream behaves like a CUDA capture in its global mode where automatic
synchronization is concerned (csrc/sim/capture.h): while one is underway every event or stream
query and every host synchronization in the process raises and invalidates it; an event recorded
on the capturing stream belongs to the capture, a stream that waits for one joins the capture,
and a capturing stream that waits for an event recorded outside it raises; ending a capture with
a joined stream whose work the capturing stream never waited for raises. Ops still run as they
are captured (the twin records no kernels), but they are race-checked only against what the same
capture touched; :meth:`Graph.replay` is one op on the current stream touching everything the
capture touched, race-checked against the rest of the program. The twin has no private memory
pool: capture each graph on a stream of its own (the default) and keep the tensors it uses.

Graphs go through the same tracker hooks as ``torch.cuda.CUDAGraph``
(``torch_pipeline/_graphs.py``).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from .. import _C, _graphs


class Graph:
    """The twin of ``torch.cuda.CUDAGraph``: ``capture_begin`` / ``capture_end`` on the current
    sim stream, ``replay`` on the current stream, ``reset``."""

    def __init__(self) -> None:
        self._graph: Optional[Any] = None
        self._stream: Optional[torch.Stream] = None

    def capture_begin(self) -> None:
        """Begins capturing on the current sim stream (which must not be a default stream)."""
        stream = torch.accelerator.current_stream()
        _graphs.capture_begin(self, lambda: _C._sim_begin_capture(stream), lambda: stream)
        self._stream = stream

    def capture_end(self) -> None:
        """Ends the capture begun by :meth:`capture_begin` (on the stream it began on; from any
        thread)."""
        if self._stream is None:
            raise RuntimeError("sim.Graph.capture_end: no capture was begun on this graph")
        stream, self._stream = self._stream, None

        def end() -> None:
            self._graph = _C._sim_end_capture(stream)

        _graphs.capture_end(self, end)

    def replay(self) -> None:
        """Replays the graph on the current stream of its device."""
        if self._graph is None:
            raise RuntimeError("sim.Graph.replay: the graph has not been captured (or was reset)")
        graph = self._graph
        _graphs.replay(self, lambda: graph.replay(torch.accelerator.current_stream()))

    @property
    def captured_ops(self) -> List[str]:
        """The ops the capture recorded, in order (``"aten::mul on sim:0 stream 3"``)."""
        return [] if self._graph is None else list(self._graph.captured_ops)

    @property
    def eager_ops(self) -> List[str]:
        """The ops the capturing thread ran while the capture was underway on streams not in it:
        on a GPU they would run once, at capture time, and never at a replay."""
        return [] if self._graph is None else list(self._graph.eager_ops)

    def reset(self) -> None:
        """Drops the captured graph."""

        def drop() -> None:
            self._graph = None

        _graphs.reset(self, drop)


class graph:
    """The twin of ``torch.cuda.graph``: synchronizes the device, captures the body on ``stream``
    (default: a new side stream, as torch.cuda.graph uses its own), then restores the current
    stream::

        g = sim.Graph()
        with sim.graph(g):
            y.copy_(x * 2)
        g.replay()
    """

    def __init__(self, sim_graph: Graph, stream: Optional[torch.Stream] = None) -> None:
        self.sim_graph = sim_graph
        self.stream = stream
        self._previous: Optional[torch.Stream] = None

    def __enter__(self) -> None:
        torch.accelerator.synchronize()  # (torch.cuda.graph synchronizes before capturing too)
        if self.stream is None:
            self.stream = _C._sim_stream_from_pool(torch.accelerator.current_device_index(), False)
        self._previous = torch.accelerator.current_stream(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)
        try:
            self.sim_graph.capture_begin()
        except BaseException:
            torch.accelerator.set_stream(self._previous)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.sim_graph.capture_end()
        finally:
            if self._previous is not None:
                torch.accelerator.set_stream(self._previous)
