"""sim.trace: a Chrome / Perfetto trace of the sim device's kernels, per stream, with waits."""
from __future__ import annotations

import json
import os
from types import TracebackType
from typing import Any, Dict, List, Optional, Tuple, Type, Union

from .. import _C


def _stream_names() -> Dict[Tuple[int, int], str]:
    """(device index, stream id) -> "pipeline worker W slot S" for every pipeline slot's stream."""
    names: Dict[Tuple[int, int], str] = {}
    for worker, priority, slot, stream in _C._slot_streams():
        if stream is None or stream.device.type != "sim":
            continue
        name = f"pipeline worker {worker} slot {slot}"
        if priority != 0:
            name += f" priority {priority}"
        names[(stream.device_index, stream.stream_id)] = name
    return names


class trace:
    """Records every kernel the sim device runs, per device and stream, and every stream wait for
    an event (drawn as an arrow from the event's stream to the waiting one), and writes them to
    ``path`` as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing) when the
    block ends. Streams of pipelines are named after their pipeline (worker thread and slot). In
    asynchronous mode the times are when the streams' threads ran the kernels, modelled latency
    included; in synchronous mode, when the calling thread did.

        >>> with sim.trace("step.json"):
        ...     train_step()

    ``events`` holds the trace's events after the block (the ``traceEvents`` of the file).
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"]) -> None:
        self.path = os.fspath(path)
        self.events: List[Dict[str, Any]] = []
        self._start_ns = 0

    def __enter__(self) -> "trace":
        if not _C._sim_enabled():
            raise RuntimeError(
                "sim.trace needs the sim device: call torch_pipeline.sim.enable() first")
        self._start_ns = _C._sim_trace_now_ns()
        _C._sim_trace_start()
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        import torch

        torch.accelerator.synchronize()  # (asynchronous mode: let the queued kernels land)
        raw = _C._sim_trace_stop()
        self.events = self._chrome_events(raw)
        with open(self.path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)

    def _chrome_events(self, raw: List[Tuple[int, str, str, int, int, str, int]]
                       ) -> List[Dict[str, Any]]:
        names = _stream_names()
        threads: Dict[str, Tuple[int, int]] = {}

        def where(label: str) -> Tuple[int, int]:
            # Labels look like "sim:0 stream 3 (exclusive)" or "sim:1 default stream".
            if label not in threads:
                device = int(label.split()[0].split(":")[1]) if label.startswith("sim:") else 0
                threads[label] = (device, len(threads) + 1)
            return threads[label]

        def us(ns: int) -> float:  # (an event recorded before the trace began: at its start)
            return max(0, ns - self._start_ns) / 1000.0

        events: List[Dict[str, Any]] = []
        flow = 0
        for kind, label, name, begin, end, from_label, from_ns in raw:
            pid, tid = where(label)
            if kind == 0:
                events.append({"name": name, "cat": "kernel", "ph": "X", "pid": pid, "tid": tid,
                               "ts": us(begin), "dur": max(0.001, us(end) - us(begin))})
                continue
            flow += 1
            fpid, ftid = where(from_label)
            # Flow arrows bind to slices: a marker slice at each end.
            events.append({"name": "event", "cat": "wait", "ph": "X", "pid": fpid, "tid": ftid,
                           "ts": us(from_ns), "dur": 1.0})
            events.append({"name": "wait", "cat": "wait", "ph": "s", "id": flow, "pid": fpid,
                           "tid": ftid, "ts": us(from_ns)})
            events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": pid, "tid": tid,
                           "ts": us(end), "dur": 1.0})
            events.append({"name": "wait", "cat": "wait", "ph": "f", "bp": "e", "id": flow,
                           "pid": pid, "tid": tid, "ts": us(end)})
        for label, (pid, tid) in threads.items():
            stream_id = _stream_id(label)
            name = label
            if stream_id is not None and (pid, stream_id) in names:
                name = f"{label}: {names[(pid, stream_id)]}"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
        for pid in sorted({p for p, _ in threads.values()}):
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": f"sim:{pid}"}})
        return events


def _stream_id(label: str) -> Optional[int]:
    parts = label.split()
    if len(parts) >= 3 and parts[1] == "stream":
        try:
            return int(parts[2])
        except ValueError:
            return None
    if "default" in parts:
        return 0
    return None
