"""The tracker part (``core::DependencyTracker``, csrc/core/dependency_tracker.h, under GoogleTest
in tests/cpp as well): here, as the runtime uses it. Per storage it keeps the last writer, the
readers since (at most one per stream) and the latest use per stream, so its records stay within
1 + 2 x streams per storage whatever the op count; per stream a clock history of at most
``kDefaultHistoryLimit`` entries; and nothing of a period after it ends.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc

import torch

from _parts import part
from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

HISTORY_LIMIT = 1024  # core::DependencyTracker::kDefaultHistoryLimit

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def test_records_stay_within_one_writer_and_a_reader_and_use_per_stream() -> None:
    pipelines = [tp.Pipeline() for _ in range(3)]
    shared = [torch.ones(64, device="sim:0") for _ in range(4)]
    for n in range(300):
        for i, p in enumerate(pipelines):
            with tp.pipeline(p):
                shared[(n + i) % 4].add_(1) if n % 7 == 0 else shared[(n + i) % 4] * 2
    tracker = part("tracker")
    streams = part("streams")["entries"]
    assert tracker["storages"] >= len(shared)
    assert tracker["records"] <= tracker["storages"] * (1 + 2 * streams)
    assert sim.races() == []


def test_clock_histories_stay_bounded() -> None:
    """Every wait changes the waiting stream's clock; two pipelines handing a tensor back and forth
    for thousands of ops must not grow the histories past their limit. (Allocator safety by
    record_stream: no poll tells the tracker that work completed, so every hand-over waits.)"""
    _C._set_allocator_safety("record_stream")
    try:
        p, q = tp.Pipeline(), tp.Pipeline()
        x = torch.zeros(64, device="sim:0")
        for _ in range(3000):
            with tp.pipeline(p):
                x = x + 1
            with tp.pipeline(q):
                x = x + 1
    finally:
        _C._set_allocator_safety("keep_alive")
    assert _C._tracking_stats()["waits"] >= 3000     # (the clocks did change)
    streams = part("streams")["entries"]
    assert part("tracker")["history"] <= streams * HISTORY_LIMIT
    assert torch.equal(x.cpu(), torch.full((64,), 6000.0))


def test_nothing_of_a_period_is_kept_after_it_ends() -> None:
    p = tp.Pipeline()
    x = torch.ones(64, device="sim:0")
    with tp.pipeline(p):
        y = x * 2
    z = y + x
    assert part("tracker")["storages"] > 0
    del p
    gc.collect()
    assert not _C._tracking_stats()["live"]
    assert part("tracker") == {"storages": 0, "records": 0, "history": 0}
    assert torch.equal(z.cpu(), torch.full((64,), 3.0))


install_proxies(globals(), __file__)
