"""The streams part (``StreamTable``, csrc/runtime/tracking/stream_table.h): an entry per stream
used in the live period, made at its first use and dropped when the period ends; each entry's log
of positions still launching, which every launch leaves settled, also when the op fails or many
threads launch on one stream at once; and the events kept by position.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from _parts import part, period
from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    from torch_pipeline import _C

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def test_an_entry_per_stream_used_in_the_period_dropped_when_it_ends() -> None:
    p, q = tp.Pipeline(), tp.Pipeline()
    first = period()
    x = torch.ones(64, device="sim:0")          # the default stream of sim:0
    with tp.pipeline(p):
        y = x * 2                               # p's stream on sim:0
        z = torch.ones(4, device="sim:1") + 1   # p's stream on sim:1
    with tp.pipeline(q):
        w = y + 1                               # q's stream on sim:0
    assert part("streams")["entries"] == 4
    with tp.pipeline(q):
        w = w + y                               # no new stream: no new entry
    assert part("streams")["entries"] == 4
    del p, q, w, y, z, x
    gc.collect()
    assert not _C._tracking_stats()["live"]
    assert part("streams") == {"entries": 0, "in_flight": 0, "events": 0}
    r = tp.Pipeline()
    assert period() > first and part("streams")["entries"] == 0   # a new period starts empty
    del r


def test_a_failed_op_leaves_no_position_launching() -> None:
    """An op launched and then failed (sizes that do not broadcast) still finishes its launch: a
    position left in flight would hold back every later event of the stream."""
    p = tp.Pipeline()
    a, b = torch.ones(3, device="sim:0"), torch.ones(4, device="sim:0")
    launches = _C._tracking_stats()["launches"]
    for _ in range(5):
        with tp.pipeline(p), pytest.raises(RuntimeError, match="must match"):
            a + b
    assert _C._tracking_stats()["launches"] >= launches + 5     # they did launch
    assert part("streams")["in_flight"] == 0
    with tp.pipeline(p):
        c = a * 2                                               # and the stream goes on
    assert torch.equal(c.cpu(), torch.full((3,), 2.0))


def test_many_threads_on_one_stream_leave_nothing_launching() -> None:
    p = tp.Pipeline()
    x = torch.ones(256, device="sim:0")
    errors = []
    samples = []

    def worker() -> None:
        try:
            with tp.pipeline(p):
                y = x
                for _ in range(300):
                    y = y + 1
                assert torch.equal(y.cpu(), torch.full((256,), 301.0))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append(part("streams"))
    for t in threads:
        t.join()
    assert errors == []
    assert part("streams")["in_flight"] == 0
    # While they ran, at most one position per launching thread was in flight.
    assert max(s["in_flight"] for s in samples) <= len(threads)
    assert max(s["entries"] for s in samples) <= 2     # the default stream and p's, on sim:0


def test_a_threads_run_on_a_stream_gets_one_event_when_it_leaves() -> None:
    """Events are recorded per run of ops on a stream, not per op: a run of a hundred ops on p's
    stream gets one event when the thread moves to q's stream."""
    p, q = tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(p):
        x = torch.ones(64, device="sim:0")   # made on p's stream: used only there below
    before = _C._tracking_stats()["events"]
    with tp.pipeline(p):
        for _ in range(100):
            x = x + 1
    assert _C._tracking_stats()["events"] == before    # the run goes on: no event yet
    with tp.pipeline(q):
        y = x * 2                   # leaves p's stream: its run gets its event, waited for
    assert _C._tracking_stats()["events"] == before + 1
    assert torch.equal(y.cpu(), torch.full((64,), 202.0))


install_proxies(globals(), __file__)
