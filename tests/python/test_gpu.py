"""Pipeline promises that need a CUDA GPU (skipped without one; run by scripts/gpu_check.sh).

Race windows are opened with torch.cuda._sleep, calibrated once per session (the cycles_per_ms
fixture of conftest.py), so that a missing wait shows up as a wrong value rather than by luck.
"""
from __future__ import annotations

import gc
from typing import Iterator

import pytest
import torch

import torch_pipeline as tp

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _untracked() -> Iterator[None]:
    """These tests check the explicit synchronization of pipelines (futures, events, waits):
    automatic synchronization, tested in test_tracking_gpu.py, stays off."""
    tp._C._set_tracking_enabled(False)
    yield
    tp._C._set_tracking_enabled(True)


def test_live_pipelines_never_share_a_cuda_stream_beyond_the_pool_size() -> None:
    assert tp._C._cuda_exclusive_streams(), "the CUDA build must own its streams"
    live = [tp.Pipeline() for _ in range(40)]  # torch's pool has 32 per priority
    streams = [p.stream("cuda:0") for p in live]
    assert len({s.cuda_stream for s in streams}) == 40
    assert all(s != torch.cuda.default_stream() for s in streams)


def test_high_priority_lane_has_a_high_priority_cuda_stream() -> None:
    least, greatest = torch.cuda.Stream.priority_range()  # torch's part of CUDA's range
    hi, lo = tp.Pipeline(priority=greatest), tp.Pipeline()
    for p, want in ((hi, greatest), (lo, least)):
        s = p.stream("cuda:0")
        got = torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index,
                                device_type=s.device_type).priority
        assert got == want
    with pytest.raises(ValueError, match="outside the range of CUDA"):
        tp.Pipeline(priority=-100)  # (CUDA's own range may reach further than torch's -3)


def test_lifetime_disjoint_pipelines_reuse_the_same_stream() -> None:
    p = tp.Pipeline()
    s = p.stream("cuda:0")
    del p
    gc.collect()
    assert tp.Pipeline().stream("cuda:0") == s


def test_entering_a_pipeline_switches_the_current_cuda_stream() -> None:
    p = tp.Pipeline()
    before = torch.cuda.current_stream()
    with p:
        assert torch.cuda.current_stream() == p.stream()
        assert isinstance(p.stream(), torch.cuda.Stream)
        with tp.default_pipeline():
            assert torch.cuda.current_stream() == before
        assert torch.cuda.current_stream() == p.stream()
    assert torch.cuda.current_stream() == before


def test_future_wait_orders_the_waiter_after_the_task_stream(cycles_per_ms: float) -> None:
    p = tp.Pipeline(1)
    out = torch.zeros(1 << 20, device="cuda")

    def produce() -> None:
        torch.cuda._sleep(int(50 * cycles_per_ms))  # on p's stream
        out.fill_(7.0)

    p.submit(produce).wait()  # the current (default) stream now waits for p's stream
    assert torch.all(out == 7.0).item()


def test_task_streams_wait_for_the_submitter(cycles_per_ms: float) -> None:
    p = tp.Pipeline(1)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(int(50 * cycles_per_ms))  # default stream busy
    x.fill_(3.0)  # still queued on the default stream when the task starts
    total = p.submit(lambda: x.sum()).wait()
    assert total.item() == 3.0 * (1 << 20)


def test_events_and_wait_pipeline_order_two_pipelines(cycles_per_ms: float) -> None:
    a, b = tp.Pipeline(), tp.Pipeline()
    x = torch.zeros(1 << 20, device="cuda")
    with a:
        torch.cuda._sleep(int(50 * cycles_per_ms))
        x.fill_(1.0)
    b.wait_pipeline(a)
    with b:
        y = x * 2
    b.synchronize()
    assert torch.all(y == 2.0).item()
    ev = a.record_event(tp.PipelineEvent(enable_timing=True))
    assert ev.devices == [torch.device("cuda", 0)]
    ev.synchronize()
    assert ev.query()
