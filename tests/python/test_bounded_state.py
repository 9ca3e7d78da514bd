"""Tracker state is bounded: O(live storages + streams), whatever the number of ops or tasks.

A training job keeps a pipeline alive for hours; the tracker must not grow with the number of ops
it observes. Each test runs a long loop (a million ops, a hundred thousand tasks) after a warm-up
and checks that the tracked storages stay within a constant of the live ones and that the
process's resident memory grows by less than 10 MiB. Before the sweep was fixed, 20,000
iterations left ~19,000 storage entries; before kept events were capped in the keep-alive poll,
in-place ops on one storage grew RSS by ~175 bytes per op.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc
import os
from typing import Callable

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, sim_enabled_fixture

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

MiB = 1 << 20


_sim_enabled = sim_enabled_fixture(num_devices=1)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def storages() -> int:
    return int(_C._tracking_stats()["storages"])


def growth(loop: Callable[[int], None], warmup: int, n: int) -> int:
    """RSS growth over loop(n) after loop(warmup)."""
    loop(warmup)
    gc.collect()
    before = rss()
    loop(n)
    gc.collect()
    return rss() - before


def test_short_lived_outputs_leave_no_entries() -> None:
    """The case of the report: 20,000 iterations of y = x * 2 in a pipeline, z = y + 1 outside."""
    p = tp.Pipeline()
    x = torch.ones(256, device="sim:0")
    for _ in range(20_000):
        with tp.pipeline(p):
            y = x * 2
        z = y + 1
        del y, z
    assert storages() < 2_000, f"{storages()} storage entries for 1 live storage"
    del p


def test_a_million_ops_over_short_and_long_lived_storages() -> None:
    p = tp.Pipeline()
    long_lived = [torch.ones(64, device="sim:0") for _ in range(8)]

    def loop(n: int) -> None:                 # 5 ops per iteration
        for i in range(n):
            t = long_lived[i % 8]
            with tp.pipeline(p):
                t.add_(1)                     # in place on a long-lived storage, off its stream
                y = t * 2                     # short-lived
            t.sub_(1)                         # back on the default stream
            z = y + t
            del y, z

    grown = growth(loop, 20_000, 200_000)
    assert storages() < 2_000, f"{storages()} storage entries for {len(long_lived)} live storages"
    assert grown < 10 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over 1e6 ops"
    assert torch.equal(long_lived[0].cpu(), torch.ones(64))
    del p


def test_a_hundred_thousand_tasks_with_tensor_arguments() -> None:
    p = tp.Pipeline(tp.get_worker_thread(1))

    def loop(n: int) -> None:
        futures = []
        for _ in range(n):
            futures.append(p.submit(lambda t: None, torch.ones(4)))
            if len(futures) >= 64:            # 64 in flight
                futures.pop(0).wait()
        for f in futures:
            f.wait()

    grown = growth(loop, 5_000, 100_000)
    assert storages() < 2_000, f"{storages()} storage entries with no live task"
    assert grown < 10 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over 1e5 tasks"
    del p


install_proxies(globals(), __file__)
