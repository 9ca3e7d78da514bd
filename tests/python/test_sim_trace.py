"""sim.trace: a Chrome / Perfetto trace of the sim device's kernels per stream, with the waits
automatic synchronization inserted drawn as flow arrows, and pipelines' streams named.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def _two_branches(pa: Any, pb: Any) -> torch.Tensor:
    x = torch.ones(1 << 12, device="sim:0") * 2          # default stream
    with tp.pipeline(pa):
        a = torch.sin(x) + 1
    with tp.pipeline(pb):
        b = torch.cos(x) * 3
    return a + b                                         # joins both on the default stream


def _threads(events: List[Dict[str, Any]]) -> Dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}


def test_trace_has_kernels_per_stream_waits_and_pipeline_names(tmp_path: Path) -> None:
    pa, pb = tp.Pipeline(), tp.Pipeline()
    path = tmp_path / "trace.json"
    with sim.trace(path) as tr:
        _two_branches(pa, pb)
    events = json.loads(path.read_text())["traceEvents"]
    assert events == tr.events
    threads = _threads(events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    names = set(threads.values())
    assert f"sim:0 stream {pa.stream('sim:0').stream_id} (exclusive): pipeline worker 0 slot " \
           f"{pa.id}" in names
    sin = next(e for e in kernels if e["name"] == "aten::sin.out")
    assert threads[sin["tid"]].endswith(f"pipeline worker 0 slot {pa.id}")
    assert {e["name"] for e in kernels} >= {"aten::mul.out", "aten::sin.out", "aten::cos.out",
                                            "aten::add.out"}
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()   # every wait is an arrow with two ends
    assert any(starts[i]["tid"] != ends[i]["tid"] for i in starts)
    assert all(e["ts"] >= 0 and e.get("dur", 0) >= 0 for e in events if e["ph"] == "X")


def test_trace_in_asynchronous_mode_shows_modelled_time_and_overlap(tmp_path: Path) -> None:
    pa, pb = tp.Pipeline(), tp.Pipeline()
    _two_branches(pa, pb)
    sim.set_asynchronous(True)
    _two_branches(pa, pb)  # the first call of each plan runs at once; the traced ones queue
    sim.set_latency(op="aten::sin.out", us=30_000)
    sim.set_latency(op="aten::cos.out", us=30_000)
    try:
        with sim.trace(tmp_path / "async.json") as tr:
            _two_branches(pa, pb)
    finally:
        sim.set_latency(op="aten::sin.out", us=None)
        sim.set_latency(op="aten::cos.out", us=None)
        sim.set_asynchronous(False)
    kernels = {e["name"]: e for e in tr.events if e.get("cat") == "kernel"}
    sin, cos = kernels["aten::sin.out"], kernels["aten::cos.out"]
    assert sin["dur"] >= 30_000 and cos["dur"] >= 30_000   # microseconds: the modelled time
    assert sin["tid"] != cos["tid"]
    assert sin["ts"] < cos["ts"] + cos["dur"] and cos["ts"] < sin["ts"] + sin["dur"]  # overlap
    add = kernels["aten::add.out"]
    assert add["ts"] >= max(sin["ts"] + sin["dur"], cos["ts"] + cos["dur"]) - 1  # after both


def test_trace_needs_the_sim_device_enabled_and_writes_on_error(tmp_path: Path) -> None:
    path = tmp_path / "err.json"
    with pytest.raises(ZeroDivisionError):
        with sim.trace(path):
            torch.ones(2, device="sim:0") + 1
            1 / 0
    assert any(e.get("cat") == "kernel" for e in json.loads(path.read_text())["traceEvents"])


install_proxies(globals(), __file__)
