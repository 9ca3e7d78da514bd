"""CUDA graphs under pipelines (docs/design.md, "Graph capture"): the GPU half of
test_capture.py, which runs the same rules on the sim device's capture twin.

``torch.cuda.graph`` captures inside a pipeline and across two pipelines (a side pipeline forked
into the capture and joined back by the tracker); a torch.cuda._sleep opens the race windows, so
a replay that is not ordered after the producer of its input, or an in-graph edge that is
missing, gives a wrong value. While a capture is underway (CUDA's global mode) another thread's
ops with storages kept alive do not query events (which would fail the capture with
cudaErrorStreamCaptureUnsupported). A side pipeline whose first op in a capture is a factory is
part of every replay; ``torch.accelerator.Graph`` replays are ordered like CUDAGraph's; a relaxed
capture may end on another thread. ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees)
under a pipeline computes what eager does. Skipped without a GPU; run by scripts/gpu_check.sh.
"""
from __future__ import annotations

import threading
from typing import Any, List

import pytest
import torch

import torch_pipeline as tp
from test_tracking_gpu import both_ways  # (with tracking, and off: the race window shows)

pytestmark = pytest.mark.gpu

N = 1 << 20


def doubling_graph(p: "tp.Pipeline", x: torch.Tensor, out: torch.Tensor) -> "torch.cuda.CUDAGraph":
    """A graph, captured inside pipeline p, that writes x * 2 into out."""
    g = torch.cuda.CUDAGraph()
    with tp.pipeline(p):
        with torch.cuda.graph(g):
            out.copy_(x * 2)
    return g


def replays_after_a_late_write(g: Any, p: "tp.Pipeline", p1: "tp.Pipeline", x: torch.Tensor,
                               out: torch.Tensor, cycles_per_ms: float) -> None:
    """g (which writes x * 2 into out) replayed on p right after x is written late on p1: with
    tracking the replay waits for p1 (and the host read for the replay), without it it races."""

    def program() -> float:
        x.zero_()
        out.zero_()
        torch.cuda.synchronize()
        with tp.pipeline(p1):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            x.fill_(1.0)                 # the static input, written late on p1
        with tp.pipeline(p):
            g.replay()                   # must wait for p1
        return out.sum().item()          # the default stream must wait for the replay

    both_ways(program, 2.0 * N)


def test_a_graph_captured_in_a_pipeline_replays_after_its_input(cycles_per_ms: float) -> None:
    p, p1 = tp.Pipeline(), tp.Pipeline()
    x = torch.zeros(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    g = doubling_graph(p, x, out)
    assert tp.tracking_stats()["captures_underway"] == 0

    replays_after_a_late_write(g, p, p1, x, out, cycles_per_ms)


def test_a_capture_across_two_pipelines_keeps_its_edges(cycles_per_ms: float) -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    side_out = torch.zeros(N, device="cuda")
    g = torch.cuda.CUDAGraph()
    forks, joins = tp.tracking_stats()["capture_forks"], tp.tracking_stats()["capture_joins"]
    with tp.pipeline(p):
        with torch.cuda.graph(g):
            y = x * 2
            with tp.pipeline(p2):
                z = torch.zeros_like(y)      # p2's first op: forks p2 into the capture
                torch.cuda._sleep(int(50 * cycles_per_ms))  # (captured: p2 is in the capture)
                torch.add(y, 1, out=z)       # late, on p2, in the graph
                side_out.copy_(z * 10)       # read by nobody on the capturing stream
            out.copy_(z * y)                 # a captured wait for p2: else it reads zeros
    stats = tp.tracking_stats()
    assert stats["capture_forks"] == forks + 1
    assert stats["capture_joins"] == joins + 1   # side_out's write, joined back at the end
    for _ in range(3):
        out.zero_()
        side_out.zero_()
        with tp.pipeline(p):
            g.replay()
        assert out.sum().item() == 6.0 * N
        assert side_out.sum().item() == 30.0 * N


def test_another_thread_does_not_query_events_during_a_capture() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(N, device="cuda")            # allocated on the default stream
    buf = torch.empty(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    with tp.pipeline(p2):
        torch.mul(x, 2, out=buf)                # x used on p2: kept alive, polled for
    paused = tp.tracking_stats()["polls_paused"]
    errors: List[BaseException] = []

    def other_thread() -> None:
        try:
            with tp.pipeline(p2):
                for _ in range(4):
                    torch.mul(x, 2, out=buf)    # (out=: no allocation during the capture)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with tp.pipeline(p):
        with torch.cuda.graph(g):               # capture_error_mode="global"
            out.copy_(x * 3)
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
    assert errors == []
    assert tp.tracking_stats()["polls_paused"] > paused
    with tp.pipeline(p):
        g.replay()
    assert out.sum().item() == 3.0 * N
    assert tp.tracking_stats()["captures_underway"] == 0  # (polls resume)


def test_storages_a_graph_uses_live_as_long_as_the_graph() -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    p = tp.Pipeline()
    x = torch.ones(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    g = doubling_graph(p, x, out)
    ref = StorageWeakRef(x.untyped_storage())
    del x
    torch.cuda.synchronize()
    assert not ref.expired()
    with tp.pipeline(p):
        g.replay()
    assert out.sum().item() == 2.0 * N
    del g
    assert ref.expired()


def test_reduce_overhead_under_a_pipeline_equals_eager(cycles_per_ms: float) -> None:
    pytest.importorskip("triton")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 16)).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    p, p1 = tp.Pipeline(), tp.Pipeline()
    inputs = [torch.randn(64, 256, device="cuda") for _ in range(4)]
    with torch.no_grad():
        expected = [model(x).clone() for x in inputs]
        got = []
        for x in inputs:
            with tp.pipeline(p1):
                torch.cuda._sleep(int(20 * cycles_per_ms))
                staged = x * 1.0             # the input, produced late on p1
            with tp.pipeline(p):
                y = compiled(staged).clone()  # (graph-tree outputs are overwritten by replays)
            got.append(y)
    torch.cuda.synchronize()
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
    assert tp.tracking_stats()["compiled_regions"] > 0


def test_a_factory_on_a_side_pipeline_is_part_of_every_replay() -> None:
    # p2's first op in the capture is a factory: p2 is forked in before it runs, so the zeros are
    # in the graph and every replay starts from them (run eagerly, once, at capture time, the
    # accumulator would keep growing from replay to replay).
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    g = torch.cuda.CUDAGraph()
    forks = tp.tracking_stats()["capture_forks"]
    with tp.pipeline(p):
        with torch.cuda.graph(g):
            y = x * 2
            with tp.pipeline(p2):
                acc = torch.zeros(N, device="cuda")
                acc.add_(y)
            out.copy_(acc)
    assert tp.tracking_stats()["capture_forks"] == forks + 1
    for _ in range(3):
        with tp.pipeline(p):
            g.replay()
        assert out.sum().item() == 2.0 * N


def test_an_accelerator_graph_replays_after_its_input(cycles_per_ms: float) -> None:
    if not hasattr(torch.accelerator, "Graph"):
        pytest.skip("this torch has no torch.accelerator.Graph")
    p, p1 = tp.Pipeline(), tp.Pipeline()
    x = torch.zeros(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    g = torch.accelerator.Graph()
    with tp.pipeline(p):
        side = torch.cuda.Stream()
        with side, g:  # (captures on a stream of its own, inside p's context)
            out.copy_(x * 2)
    assert tp.tracking_stats()["captures_underway"] == 0

    replays_after_a_late_write(g, p, p1, x, out, cycles_per_ms)


def test_a_relaxed_capture_may_end_on_another_thread() -> None:
    p = tp.Pipeline()
    x = torch.ones(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with tp.pipeline(p):
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="relaxed")
            out.copy_(x * 2)
    errors: List[BaseException] = []

    def end() -> None:
        try:
            with torch.cuda.stream(s):
                g.capture_end()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=end)
    t.start()
    t.join()
    assert errors == []
    stats = tp.tracking_stats()
    assert stats["captures_underway"] == 0 and stats["queries_paused"] == 0
    with tp.pipeline(p):
        g.replay()
    assert out.sum().item() == 2.0 * N
