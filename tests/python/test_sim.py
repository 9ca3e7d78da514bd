"""The sim device (docs/design.md, "The sim device"): a race-detecting simulated accelerator.

Plain PyTorch programs (no torch_pipeline pipelines unless a test says so), each asserting the race
checker's verdict both ways: the racy program is reported, the correctly synchronized one is not.
Plus: ops on sim compute what they compute on the CPU (a hand-picked set; the whole OpInfo
database is in test_sim_opinfo.py), and a 1000-op program is checked in well under a second.

Enabling sim renames PyTorch's PrivateUse1 backend for the rest of the process and makes "sim"
torch.accelerator's device, which other test files (that expect no accelerator on a CPU machine)
must not see. So this module runs in a child pytest process of its own (see _sim_child.py). Set
TORCH_PIPELINE_SIM_TEST_CHILD=1 to run the tests in-process.
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, sim_enabled_fixture
N = 3000  # elements of the tensors used below (a size no other test tensor has)

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim


# ---- fixtures and helpers (child process) --------------------------------------------------------
_sim_enabled = sim_enabled_fixture(num_devices=2)


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    """Each test starts on the default streams with a synchronized host, no races, untracked."""
    if not IN_CHILD:
        yield
        return

    def reset() -> None:
        # These tests check the device and the explicit synchronization of pipelines (events,
        # waits, tasks): automatic synchronization, tested in test_tracking.py, stays off.
        tp._C._set_tracking_enabled(False)
        sim.set_strict(False)
        for d in range(2):
            torch.accelerator.set_stream(default_stream(d))
        torch.accelerator.set_device_index(0)
        sim.synchronize(0)
        sim.synchronize(1)
        sim.clear_races()

    reset()
    yield
    reset()


def default_stream(device: int = 0) -> torch.Stream:
    return torch.Stream(stream_id=0, device_index=device, device_type=_sim_type())


def _sim_type() -> int:
    return torch.accelerator.current_stream(0).device_type


def current(device: int = 0) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def label(stream: torch.Stream) -> str:
    return sim._C._sim_stream_label(stream)


def races_on(t: torch.Tensor) -> List[Any]:
    """The races whose bytes lie in t's storage."""
    base = t.untyped_storage().data_ptr()
    end = base + t.untyped_storage().nbytes()
    return [r for r in sim.races() if r.begin < end and r.end > base]


def races_at(ptr: int, nbytes: int) -> List[Any]:
    return [r for r in sim.races() if r.begin < ptr + nbytes and r.end > ptr]


def settled(t: torch.Tensor) -> torch.Tensor:
    """t after the host waited for every stream (so later uses are ordered after its writes)."""
    sim.synchronize(t.device.index)
    return t


# ---- read after write ------------------------------------------------------------------------
def test_side_stream_read_without_wait_races() -> None:
    x = torch.ones(N, device="sim:0")  # written on the default stream
    s = torch.Stream(device="sim:0")
    with s:
        y = x * 2
    # (If x's block was reused from the pool, its allocation is a write on the default stream
    # that the read races with as well: not what this test is about.)
    found = [r for r in races_on(x) if not r.earlier_op.startswith("allocation")]
    assert len(found) == 1
    r = found[0]
    assert r.earlier_op == "aten::fill_.Scalar" and r.earlier_write
    assert r.later_op.startswith("aten::mul") and not r.later_write
    assert r.earlier_stream == label(default_stream(0)) == "sim:0 stream 0 (default)"
    assert r.later_stream == label(s) and r.later_stream != r.earlier_stream
    assert (r.begin, r.end) == (x.data_ptr(), x.data_ptr() + N * 4)
    text = str(r)
    for part in (r.earlier_op, r.later_op, r.earlier_stream, r.later_stream, "sim:0 storage"):
        assert part in text
    assert "read" in text and "write" in text
    assert torch.equal(settled(y).cpu(), torch.full((N,), 2.0))


def test_side_stream_read_after_wait_stream_is_clean() -> None:
    x = torch.ones(N, device="sim:0")
    s = torch.Stream(device="sim:0")
    s.wait_stream(current(0))
    with s:
        y = x * 2
    assert sim.races() == []
    current(0).wait_stream(s)
    assert torch.equal(y.cpu(), torch.full((N,), 2.0))
    assert sim.races() == []


def test_default_stream_read_of_side_stream_result_races_without_wait() -> None:
    s = torch.Stream(device="sim:0")
    with s:
        y = torch.arange(N, device="sim:0", dtype=torch.float32)
    z = y + 1  # default stream, no wait
    found = races_on(y)
    assert found and all(r.later_stream == label(default_stream(0)) for r in found)
    assert any(r.earlier_op.startswith("aten::arange") for r in found)
    sim.clear_races()
    with s:
        y2 = torch.arange(N, device="sim:0", dtype=torch.float32)
    current(0).wait_stream(s)
    z2 = y2 + 1
    assert races_on(y2) == [] and races_on(z2) == []
    assert torch.equal(z2.cpu(), torch.arange(N, dtype=torch.float32) + 1)
    del z


# ---- write after read ------------------------------------------------------------------------
def test_write_after_read_across_streams_races() -> None:
    x = settled(torch.ones(N, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        total = x.sum()  # read on s
    x.add_(1)  # write on the default stream, not ordered after the read
    found = races_on(x)
    assert len(found) == 1
    r = found[0]
    assert not r.earlier_write and r.earlier_stream == label(s)
    assert r.later_write and r.later_stream == label(default_stream(0))
    assert r.later_op.startswith("aten::add")
    del total


def test_write_after_read_with_wait_is_clean() -> None:
    x = settled(torch.ones(N, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        total = x.sum()
    current(0).wait_stream(s)
    x.add_(1)
    assert sim.races() == []
    assert total.item() == N and torch.equal(x.cpu(), torch.full((N,), 2.0))
    assert sim.races() == []


def test_write_after_write_across_streams() -> None:
    x = settled(torch.zeros(N, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        x.fill_(1)
    x.fill_(2)
    assert len(races_on(x)) == 1 and races_on(x)[0].earlier_write and races_on(x)[0].later_write
    sim.clear_races()
    s.wait_stream(current(0))
    with s:
        x.fill_(3)
    current(0).wait_stream(s)
    x.fill_(4)
    assert sim.races() == []


# ---- use after free and the allocator ----------------------------------------------------------
def test_use_after_free_without_record_stream_races() -> None:
    x = torch.ones(N, device="sim:0")
    s = torch.Stream(device="sim:0")
    s.wait_stream(current(0))
    with s:
        y = x * 2  # s reads x
    ptr = x.data_ptr()
    del x  # back to the default stream's pool at once: s may still be reading it
    z = torch.empty(N, device="sim:0")
    assert z.data_ptr() == ptr  # reused at once by the default stream
    found = races_at(ptr, N * 4)
    assert len(found) == 1
    r = found[0]
    assert r.later_op.startswith("allocation (reuses a block freed on sim:0 stream 0 (default))")
    assert r.later_write and r.later_stream == label(default_stream(0))
    assert r.earlier_op.startswith("aten::mul") and r.earlier_stream == label(s)
    assert not r.earlier_write
    del y


def test_use_after_free_with_record_stream_is_clean() -> None:
    x = torch.ones(N, device="sim:0")
    s = torch.Stream(device="sim:0")
    s.wait_stream(current(0))
    with s:
        y = x * 2
    x.record_stream(s)
    ptr = x.data_ptr()
    del x  # held back until s's use completes
    z = torch.empty(N, device="sim:0")
    assert z.data_ptr() == ptr  # its use completed, so the block came back at this allocation
    assert sim.races() == []
    del y


def test_use_after_free_made_safe_by_waiting_before_the_free() -> None:
    x = torch.ones(N, device="sim:0")
    s = torch.Stream(device="sim:0")
    s.wait_stream(current(0))
    with s:
        y = x * 2
    current(0).wait_stream(s)
    del x
    z = torch.ones(N, device="sim:0")
    assert sim.races() == []
    del y, z


def test_blocks_return_to_the_pool_of_their_allocation_stream() -> None:
    s = torch.Stream(device="sim:0")
    with s:
        a = torch.empty(N + 7, device="sim:0")
    ptr = a.data_ptr()
    del a
    b = torch.empty(N + 7, device="sim:0")  # default stream: another pool
    assert b.data_ptr() != ptr
    with s:
        c = torch.empty(N + 7, device="sim:0")
    assert c.data_ptr() == ptr
    assert sim.races() == []


def test_memory_stats_follow_allocations() -> None:
    before = torch.accelerator.memory_allocated(0)
    x = torch.empty(1 << 20, device="sim:0")
    assert torch.accelerator.memory_allocated(0) >= before + (4 << 20)
    del x
    assert torch.accelerator.memory_allocated(0) == before


def test_memory_stats_count_active_blocks() -> None:
    before = torch.accelerator.memory_stats(0)["active.all.current"]
    xs = [torch.empty(N, device="sim:0") for _ in range(3)]
    assert torch.accelerator.memory_stats(0)["active.all.current"] == before + 3
    del xs
    assert torch.accelerator.memory_stats(0)["active.all.current"] == before


@pytest.mark.parametrize("kind", ["factory", "fallback"])
def test_record_stream_release_orders_the_reuse_of_that_block_only(kind: str) -> None:
    """The allocator learning that a record_stream()'d use completed (when it hands the block out
    again) orders that block's reuse, not the host nor any stream: other memory the side stream
    wrote is still unordered for the default stream."""
    s = torch.Stream(device="sim:0")
    other = settled(torch.zeros(N, device="sim:0"))
    t = settled(torch.zeros(N, device="sim:0"))
    src = settled(torch.zeros(N, device="sim:0"))
    with s:
        other.fill_(2)  # written on s; the default stream never waits for s
        t.add_(1)
    t.record_stream(s)
    ptr = t.data_ptr()
    del t
    if kind == "factory":  # the allocator reports the reuse as an op of its own
        z = torch.empty(N, device="sim:0")
    else:  # the fallback allocates add's result: the reuse is reported with add's accesses
        z = src + 1
    assert z.data_ptr() == ptr  # the block came back and was reused on the default stream
    assert races_at(ptr, N * 4) == []  # its use on s is complete for the allocator
    _ = other.sum()  # default stream, not ordered after s: a race on a GPU
    found = races_on(other)
    assert len(found) == 1
    assert found[0].earlier_op == "aten::fill_.Scalar" and found[0].earlier_stream == label(s)
    assert found[0].later_stream == label(default_stream(0))


# ---- cross-device copies -----------------------------------------------------------------------
def test_cross_device_copy_is_ordered_after_both_current_streams() -> None:
    x = torch.arange(N, device="sim:0", dtype=torch.float32)
    y = x.to("sim:1")  # after sim:0's and sim:1's current streams, like CUDA
    z = y * 2  # sim:1's current stream: after the copy
    back = z.to("sim:0")
    assert sim.races() == []
    assert y.device == torch.device("sim:1") and back.device == torch.device("sim:0")
    assert torch.equal(back.cpu(), torch.arange(N, dtype=torch.float32) * 2)


def test_cross_device_copy_of_side_stream_data_races() -> None:
    s0 = torch.Stream(device="sim:0")
    with s0:
        x = torch.ones(N, device="sim:0")  # written on a side stream of sim:0
    y = x.to("sim:1")  # ordered after sim:0's current (default) stream only
    found = races_on(x)
    assert len(found) >= 1 and found[0].earlier_stream == label(s0)
    assert "sim:0 -> sim:1" in found[0].later_op
    assert found[0].later_stream == label(current(1))
    sim.clear_races()
    with s0:
        x2 = torch.ones(N, device="sim:0")
    current(0).wait_stream(s0)
    y2 = x2.to("sim:1")
    assert sim.races() == []
    assert torch.equal(y2.cpu(), torch.ones(N))
    del y


def test_cross_device_copy_into_data_of_a_destination_side_stream_races() -> None:
    s1 = torch.Stream(device="sim:1")
    dst = settled(torch.zeros(N, device="sim:1"))
    with s1:
        dst.add_(1)  # written on a side stream of sim:1
    src = torch.ones(N, device="sim:0")
    dst.copy_(src)  # write on sim:1's current stream
    assert races_on(dst) and races_on(dst)[0].earlier_stream == label(s1)
    sim.clear_races()
    s1.wait_stream(current(1))
    with s1:
        dst.add_(1)
    current(1).wait_stream(s1)
    dst.copy_(src)
    assert sim.races() == []


# ---- non_blocking copies -----------------------------------------------------------------------
def test_non_blocking_copy_to_sim_read_without_wait_races() -> None:
    host = torch.ones(N).pin_memory()
    s = torch.Stream(device="sim:0")
    with s:
        y = host.to("sim:0", non_blocking=True)
    z = y + 1  # default stream
    found = races_on(y)
    assert found and any("non_blocking" in r.earlier_op for r in found)
    assert all(r.earlier_stream == label(s) for r in found)
    sim.clear_races()
    with s:
        y2 = host.to("sim:0", non_blocking=True)
    current(0).wait_stream(s)
    z2 = y2 + 1
    assert sim.races() == []
    assert torch.equal(z2.cpu(), torch.full((N,), 2.0))
    del z


def test_non_blocking_copy_to_host_does_not_synchronize() -> None:
    x = torch.ones(N, device="sim:0")
    host = x.to("cpu", non_blocking=True)  # reads x on the default stream, host does not wait
    assert host.is_pinned() or torch.cuda.is_available()  # (CUDA's pinned memory if it has a GPU)
    s = torch.Stream(device="sim:0")
    with s:
        x.add_(1)  # races with the copy's read (and with ones' write)
    found = races_on(x)
    assert any("non_blocking" in r.earlier_op and not r.earlier_write for r in found)
    current(0).synchronize()
    assert torch.equal(host, torch.ones(N))


SIM_PINNED = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a GPU, pin_memory() gives CUDA's pinned memory")


@SIM_PINNED
def test_host_read_of_an_async_copy_result_before_the_sync_races() -> None:
    x = torch.full((N,), 4.0, device="sim:0")
    host = x.to("cpu", non_blocking=True)  # the copy writes host memory on the default stream
    total = host.sum()  # the host reads it without waiting: a race (recorded, never raised)
    found = races_on(host)
    assert len(found) == 1
    r = found[0]
    assert r.later_stream == "host" and r.later_op.startswith("aten::sum") and not r.later_write
    assert "non_blocking" in r.earlier_op and r.earlier_write
    assert r.earlier_stream == label(default_stream(0)) and "pinned host memory" in str(r)
    sim.clear_races()
    host2 = x.to("cpu", non_blocking=True)
    current(0).synchronize()
    assert host2.sum().item() == 4.0 * N and sim.races() == []
    del total


@SIM_PINNED
def test_host_write_of_an_async_copy_source_before_the_sync_races() -> None:
    src = torch.ones(N).pin_memory()
    y = src.to("sim:0", non_blocking=True)  # the copy reads host memory on the default stream
    src.fill_(3)  # the host overwrites it without waiting
    found = races_on(src)
    assert len(found) == 1 and found[0].later_write and found[0].later_stream == "host"
    sim.clear_races()
    src2 = torch.ones(N).pin_memory()
    y2 = src2.to("sim:0", non_blocking=True)
    e = torch.Event(device="sim:0")
    e.record()
    e.synchronize()
    src2.fill_(3)
    src2.sum()
    assert sim.races() == [] and torch.equal(y2.cpu(), torch.ones(N))
    del y


@SIM_PINNED
def test_async_copies_with_pinned_memory_on_one_stream_do_not_race() -> None:
    """The host-side check watches host ops, not the device's copies: copies with pinned memory
    queued on one stream are ordered by that stream."""
    x = torch.ones(N, device="sim:0")
    p = torch.empty(N).pin_memory()
    sim.synchronize(0)
    p.copy_(x, non_blocking=True)  # D2H into p, pending
    p.copy_(x, non_blocking=True)  # again, after the first one on the stream
    y = torch.empty(N, device="sim:0")
    y.copy_(p, non_blocking=True)  # H2D from p, after the D2H on the stream
    z = p.to("sim:0", non_blocking=True)  # the same through aten::to / _to_copy
    assert sim.races() == []
    _ = p.sum()  # a host op still sees the pending D2H
    assert len(races_on(p)) == 1 and races_on(p)[0].later_stream == "host"
    current(0).synchronize()
    assert torch.equal(y.cpu(), torch.ones(N)) and torch.equal(z.cpu(), torch.ones(N))


@SIM_PINNED
def test_host_read_of_an_async_copy_result_inside_a_view_op_races() -> None:
    """p.to(dtype) is aten::to (an aliasing op that reads nothing itself) around aten::_to_copy,
    which reads p: the inner op is checked."""
    x = torch.ones(N, device="sim:0")
    p = torch.empty(N).pin_memory()
    sim.synchronize(0)
    p.copy_(x, non_blocking=True)
    z = p.to(torch.float64)
    found = races_on(p)
    assert len(found) == 1
    assert found[0].later_stream == "host" and found[0].later_op.startswith("aten::_to_copy")
    assert not found[0].later_write and found[0].earlier_write
    current(0).synchronize()
    assert torch.equal(z, torch.ones(N, dtype=torch.float64))


@SIM_PINNED
def test_metadata_queries_of_pinned_memory_an_async_copy_writes_do_not_race() -> None:
    """Queries that read only metadata (sizes, strides, TensorImpl types: the list of ops that touch
    no data in csrc/runtime/op_facts.cpp, which the tracker uses too) are not host reads."""
    x = torch.ones(N, device="sim:0")
    p = torch.empty(N).pin_memory()
    q = torch.empty(N)
    sim.synchronize(0)
    p.copy_(x, non_blocking=True)  # D2H into p, pending
    assert p.is_same_size(q) and torch._has_compatible_shallow_copy_type(p, q)
    assert torch.ops.aten.stride.int(p, 0) == 1 and not p.is_set_to(q)
    assert sim.races() == []
    _ = p.sum()  # a read of the data still races
    assert len(races_on(p)) == 1 and races_on(p)[0].later_op.startswith("aten::sum")
    current(0).synchronize()


@SIM_PINNED
def test_freeing_pinned_memory_stops_watching_it() -> None:
    x = torch.ones(N, device="sim:0")
    p = torch.empty(N).pin_memory()
    sim.synchronize(0)
    p.copy_(x, non_blocking=True)
    assert sim._C._sim_pending_host_accesses() == 1
    del p  # back to the cache (a bug on a GPU before the copy completes; complete here)
    assert sim._C._sim_pending_host_accesses() == 0


@SIM_PINNED
def test_a_freed_pinned_block_is_handed_out_again() -> None:
    """Sim's pinned memory is PrivateUse1's host allocator, caching like CUDA's: a freed block goes
    back to the cache of its size (a power of two) and the next pinned allocation of that size gets
    it again, with no new block from the system and no race with the copies that used it before
    (they are complete when it is freed); empty_host_cache() gives the cached blocks back."""
    x = torch.ones(N, device="sim:0")
    sim.empty_host_cache()
    before = sim.host_memory_stats()
    p = torch.empty(N).pin_memory()
    ptr = p.data_ptr()
    p.copy_(x, non_blocking=True)  # the default stream writes p
    del p
    q = torch.empty(N - 10, pin_memory=True)
    assert q.data_ptr() == ptr and q.is_pinned()
    q.fill_(2.0)  # a host write of the block: its earlier copy is history
    assert sim.races() == []
    stats = sim.host_memory_stats()
    assert stats["num_host_alloc"] == before["num_host_alloc"] + 1
    assert stats["allocations.current"] == before["allocations.current"] + 1
    assert stats["active_requests.current"] == before["active_requests.current"] + 1
    del q
    assert sim.host_memory_stats()["allocations.current"] == before["allocations.current"] + 1
    sim.empty_host_cache()
    stats = sim.host_memory_stats()
    assert stats["allocations.current"] == before["allocations.current"]
    assert stats["num_host_free"] == before["num_host_free"] + 1


@pytest.mark.skipif(not hasattr(torch.accelerator, "empty_host_cache"),
                    reason="torch.accelerator.empty_host_cache is newer than this torch")
def test_empty_host_cache_after_the_device_is_initialized() -> None:
    """torch.accelerator.empty_host_cache() calls PrivateUse1's host allocator once PyTorch counts
    the device as initialized (a Python factory made a sim tensor): it once was a null pointer."""
    x = torch.ones(N, device="sim:0")
    torch.accelerator.empty_host_cache()
    assert x.sum().item() == N


def test_blocking_copy_to_host_synchronizes_the_stream() -> None:
    x = torch.ones(N, device="sim:0")
    host = x.cpu()  # the host waits for the default stream
    s = torch.Stream(device="sim:0")
    with s:
        x.add_(1)  # ordered after everything the host saw
    assert sim.races() == []
    assert torch.equal(host, torch.ones(N))


def test_item_synchronizes_the_stream() -> None:
    s = torch.Stream(device="sim:0")
    with s:
        y = torch.full((N,), 3.0, device="sim:0")
        assert y[0].item() == 3.0  # .item() waits for s
    z = y + 1
    assert sim.races() == []
    del z


@pytest.mark.parametrize("how", ["tensor", "storage"])
def test_growing_resize_copies_the_old_bytes_on_the_current_stream(how: str) -> None:
    def grow(x: torch.Tensor) -> None:
        if how == "tensor":
            x.resize_(2 * N)
        else:
            x.untyped_storage().resize_(2 * N * 4)

    s = torch.Stream(device="sim:0")
    x = settled(torch.zeros(N, device="sim:0"))
    with s:
        x.fill_(3)  # written on s
    old = x.data_ptr()
    grow(x)  # default stream: reads the old bytes into a new block, not ordered after s
    assert x.data_ptr() != old
    found = races_at(old, N * 4)
    assert len(found) == 1
    assert found[0].earlier_op == "aten::fill_.Scalar" and found[0].earlier_stream == label(s)
    assert found[0].later_op.startswith("aten::resize_") and not found[0].later_write
    assert found[0].later_stream == label(default_stream(0))
    sim.clear_races()
    with s:
        _ = x.sum()  # the new block was written on the default stream: s reads it unordered
    found = races_on(x)
    assert found and found[0].earlier_op.startswith("aten::resize_") and found[0].earlier_write
    sim.synchronize(0)
    sim.clear_races()
    # ordered: clean, and the values survive
    y = settled(torch.zeros(N, device="sim:0"))
    s.wait_stream(current(0))
    with s:
        y.fill_(3)
    current(0).wait_stream(s)
    grow(y)
    assert sim.races() == []
    assert torch.equal(y[:N].cpu(), torch.full((N,), 3.0))


def test_strict_mode_raises_at_a_racy_resize_before_it_resizes() -> None:
    s = torch.Stream(device="sim:0")
    x = settled(torch.zeros(N, device="sim:0"))
    with s:
        x.fill_(3)
    sim.set_strict(True)
    with pytest.raises(sim.RaceError, match="resize_"):
        x.resize_(2 * N)
    assert x.shape == (N,) and x.untyped_storage().nbytes() == N * 4


# ---- views -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "first, second",
    [
        (lambda x: x[:4], lambda x: x[4:]),  # rows
        (lambda x: x[:, :4], lambda x: x[:, 4:]),  # columns
        (lambda x: x.view(-1)[::2], lambda x: x.view(-1)[1::2]),  # interleaved
        (lambda x: x.t()[0], lambda x: x.t()[1]),  # strided columns
        (lambda x: x.view(-1)[10:20], lambda x: x.view(-1)[20:30]),  # view of a view
        (lambda x: x[2:3, 1:7], lambda x: x[3:5, 1:7]),  # blocks
    ],
)
def test_disjoint_views_of_one_storage_do_not_race(first: Callable, second: Callable) -> None:
    x = settled(torch.zeros(8, 8, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        first(x).fill_(1)
    second(x).fill_(2)
    assert sim.races() == []


@pytest.mark.parametrize(
    "first, second, overlap",
    [
        (lambda x: x[:5], lambda x: x[4:], (4 * 8, 5 * 8)),  # one shared row
        (lambda x: x[:, :5], lambda x: x[:, 4:], (4, 5)),  # one shared column: first run
        (lambda x: x.view(-1)[::3], lambda x: x.view(-1)[::2], (0, 1)),  # shared elements
        (lambda x: x, lambda x: x[7, 7:], (63, 64)),  # the last element
    ],
)
def test_overlapping_views_race(first: Callable, second: Callable, overlap: Tuple[int, int]) -> None:
    x = settled(torch.zeros(8, 8, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        first(x).fill_(1)
    second(x).fill_(2)
    found = sim.races()
    assert found
    assert found[0].begin == x.data_ptr() + overlap[0] * 4
    assert found[0].end == x.data_ptr() + overlap[1] * 4


@pytest.mark.parametrize(
    "shape, first, second",
    [
        ((65, 1024), lambda x: x[:, :512], lambda x: x[:, 512:]),  # 65 runs each
        ((1000,), lambda x: x[0::2], lambda x: x[1::2]),  # 500 runs each
        ((1 << 17,), lambda x: x[0::2], lambda x: x[1::2]),  # 65536 runs each
        ((2, 300, 300), lambda x: x[0, :, 0::2], lambda x: x[1, :, 1::2]),  # 45000 runs each
        # over kMaxRuns (262144 runs): each row is covered by its bounding range, rows stay exact
        ((4, 1 << 17), lambda x: x[:2, 0::2], lambda x: x[2:, 1::2]),
    ],
)
def test_disjoint_views_with_many_runs_do_not_race(
    shape: Tuple[int, ...], first: Callable, second: Callable
) -> None:
    x = settled(torch.zeros(shape, device="sim:0"))
    s = torch.Stream(device="sim:0")
    start = time.perf_counter()
    with s:
        first(x).fill_(1)
    second(x).fill_(2)
    elapsed = time.perf_counter() - start
    assert sim.races() == []
    assert elapsed < 2.0
    sim.synchronize(0)
    assert first(x).eq(1).all().item() and second(x).eq(2).all().item()


def test_overlapping_views_with_many_runs_race_on_the_shared_bytes_only() -> None:
    x = settled(torch.zeros(65, 1024, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        x[:, :513].fill_(1)
    x[:, 512:].fill_(2)
    found = sim.races()
    assert len(found) == 65  # one shared element per row
    shared = [x.data_ptr() + (row * 1024 + 512) * 4 for row in range(65)]
    assert sorted((r.begin, r.end) for r in found) == [(b, b + 4) for b in shared]


def test_views_share_storage_and_record_no_access() -> None:
    x = settled(torch.arange(64, device="sim:0", dtype=torch.float32))
    s = torch.Stream(device="sim:0")
    with s:  # metadata only: no race although s never waited
        views = [x.view(8, 8), x[3:], x.view(8, 8).t(), x.unfold(0, 4, 2), x.as_strided((4,), (3,)),
                 x.view(8, 8).diagonal(), x.view(torch.int32), torch.view_as_complex(x.view(32, 2))]
    assert sim.races() == []
    for v in views:
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x.view(8, 8)[1, 2] = 100.0
    assert x[10].item() == 100.0


# ---- events ------------------------------------------------------------------------------------
def test_event_recorded_on_one_stream_and_waited_on_another() -> None:
    x = torch.ones(N, device="sim:0")
    e = torch.Event(device="sim:0")
    e.record(current(0))
    s = torch.Stream(device="sim:0")
    s.wait_event(e)
    with s:
        y = x * 2
    assert sim.races() == []
    # an event recorded before a write does not cover it
    x2 = settled(torch.ones(N, device="sim:0"))
    e2 = torch.Event(device="sim:0")
    e2.record(current(0))
    x2.fill_(5)
    s.wait_event(e2)
    with s:
        y = x2 * 2
    assert len(races_on(x2)) == 1 and races_on(x2)[0].earlier_op == "aten::fill_.Scalar"


def test_event_of_side_stream_orders_a_later_default_stream_write() -> None:
    x = settled(torch.ones(N, device="sim:0"))
    s = torch.Stream(device="sim:0")
    with s:
        y = x * 2
    e = s.record_event()
    current(0).wait_event(e)
    x.add_(1)
    assert sim.races() == []
    del y


def test_event_query_and_synchronize_join_the_host() -> None:
    s = torch.Stream(device="sim:0")
    with s:
        x = torch.ones(N, device="sim:0")
    e = s.record_event()
    assert e.query()  # completion seen by the host
    y = x + 1  # enqueued on the default stream after the host saw the completion
    assert sim.races() == []

    def side_write(value: float) -> None:
        s.wait_stream(current(0))  # after the default stream's read of x
        with s:
            x.fill_(value)

    side_write(2)
    s.record_event().synchronize()
    y = x + 1
    side_write(3)
    s.synchronize()
    y = x + 1
    side_write(4)
    assert s.query()
    y = x + 1
    side_write(5)
    torch.accelerator.synchronize(0)
    y = x + 1
    side_write(6)
    tp.synchronize()
    y = x + 1
    assert sim.races() == [] and torch.equal(y.cpu(), torch.full((N,), 7.0))
    side_write(7)
    y = x + 1  # no host synchronization: the read races with the write
    assert len(races_on(x)) == 1


def test_event_elapsed_time() -> None:
    a = torch.Event(device="sim:0", enable_timing=True)
    b = torch.Event(device="sim:0", enable_timing=True)
    a.record()
    torch.randn(64, 64, device="sim:0") @ torch.randn(64, 64, device="sim:0")
    b.record()
    b.synchronize()
    assert a.elapsed_time(b) >= 0.0
    c = torch.Event(device="sim:0")
    c.record()
    with pytest.raises((RuntimeError, ValueError), match="enable_timing"):
        a.elapsed_time(c)
    # Events of two devices cannot be timed against each other (CUDA raises RuntimeError too).
    d = torch.Event(device="sim:1", enable_timing=True)
    d.record(torch.accelerator.current_stream(1))
    d.synchronize()
    with pytest.raises(RuntimeError, match="recorded on sim:0 and sim:1"):
        a.elapsed_time(d)


def test_one_event_recorded_and_waited_on_from_many_threads() -> None:
    """record() on some threads while wait/synchronize/query read the event on others, with
    clocks growing meanwhile (new exclusive streams): the event's state is guarded."""
    import threading

    e = torch.Event(device="sim:0")
    stop = threading.Event()
    errors: List[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                while not stop.is_set():
                    fn()
            except BaseException as ex:  # noqa: BLE001
                errors.append(ex)
        return run

    s, w = torch.Stream(device="sim:0"), torch.Stream(device="sim:0")
    threads = [threading.Thread(target=guarded(f)) for f in (
        lambda: e.record(s), lambda: e.record(s),
        lambda: (e.wait(w), e.synchronize(), e.query()), lambda: (e.wait(w), e.synchronize()))]
    for t in threads:
        t.start()
    try:
        pipelines = [tp.Pipeline() for _ in range(64)]
        for p in pipelines:
            p.stream("sim:0")  # a new timeline each: every clock grows
        time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    e.record(s)
    w.wait_event(e)
    e.synchronize()
    assert e.query()


def test_synchronize_rejects_negative_devices() -> None:
    for bad in (-5, -1):
        with pytest.raises(ValueError, match="must be >= 0"):
            sim.synchronize(bad)
    with pytest.raises(ValueError, match="-1"):
        sim._C._sim_synchronize(-5)
    sim._C._sim_synchronize(-1)  # the binding's "every device"


# ---- strict mode -------------------------------------------------------------------------------
def test_strict_mode_raises_at_the_racing_op_before_it_runs() -> None:
    x = torch.ones(N, device="sim:0")
    y = settled(torch.zeros(N, device="sim:0"))
    x.fill_(7)  # default stream, after the host sync: the racy write
    sim.set_strict(True)
    s = torch.Stream(device="sim:0")
    with s:
        with pytest.raises(sim.RaceError) as info:
            y.copy_(x)  # reads x on s without waiting for fill_
    assert isinstance(info.value, RuntimeError)
    assert "aten::fill_.Scalar" in str(info.value) and "aten::copy_" in str(info.value)
    assert label(s) in str(info.value)
    sim.set_strict(False)
    sim.synchronize(0)
    assert torch.equal(y.cpu(), torch.zeros(N))  # the kernel did not run
    assert races_on(x)  # recorded as well


def test_strict_mode_raises_at_a_racy_reuse() -> None:
    # The allocator hands out the most recently freed block of a size: no garbage collection may
    # free another block of x's size between `del x` and the reuse (earlier tests' cycles).
    gc.collect()
    gc.disable()
    try:
        x = torch.ones(N, device="sim:0")
        s = torch.Stream(device="sim:0")
        s.wait_stream(current(0))
        with s:
            y = x * 2
        del x
        sim.set_strict(True)
        with pytest.raises(sim.RaceError, match="allocation"):
            torch.empty(N, device="sim:0")
        del y
    finally:
        gc.enable()


def test_strict_mode_lets_a_synchronized_program_run() -> None:
    sim.set_strict(True)
    x = torch.ones(N, device="sim:0")
    s = torch.Stream(device="sim:0")
    s.wait_stream(current(0))
    with s:
        y = x * 2
    x.record_stream(s)
    current(0).wait_stream(s)
    del x
    z = torch.empty(N, device="sim:0")
    z.copy_(y)
    assert torch.equal(z.cpu(), torch.full((N,), 2.0))
    assert sim.races() == []


def test_backward_of_a_side_stream_forward_is_ordered_by_autograd() -> None:
    w = settled(torch.ones(N, device="sim:0", requires_grad=True))
    s = torch.Stream(device="sim:0")
    s.wait_stream(current(0))
    with s:
        loss = (w * 3).sum()
    sim.set_strict(True)
    loss.backward()  # the engine syncs the default stream with s, and runs MulBackward on s
    current(0).wait_stream(s)
    assert torch.equal(w.grad.cpu(), torch.full((N,), 3.0))
    assert sim.races() == []


# ---- streams, devices and the API --------------------------------------------------------------
def test_enable_is_idempotent_and_the_count_is_fixed() -> None:
    sim.enable(num_devices=2)
    assert sim.is_enabled() and sim.device_count() == 2 and torch.accelerator.device_count() == 2
    with pytest.raises(ValueError, match="num_devices=2"):
        sim.enable(num_devices=3)
    with pytest.raises(TypeError):
        sim.enable(num_devices="2")  # type: ignore[arg-type]
    sim.enable(num_devices=2, strict=True)
    assert sim.is_strict()
    sim.enable(num_devices=2)
    assert not sim.is_strict()


def test_sim_is_the_accelerator_with_torch_device_module() -> None:
    assert torch.accelerator.current_accelerator() == torch.device("sim")
    assert torch.sim is sim and torch.sim.is_available() and torch.sim.device_count() == 2
    x = torch.ones(2).sim()
    assert x.is_sim and x.device == torch.device("sim:0")
    sim.set_device(1)
    assert sim.current_device() == 1 and torch.ones(1, device="sim").device.index == 1
    sim.set_device(0)
    with pytest.raises(ValueError, match="does not exist"):
        torch.ones(1, device="sim:5")
    # A RuntimeError too, as CUDA's "invalid device ordinal": code that catches that still works.
    for bad in (lambda: torch.ones(1, device="sim:5"), lambda: torch.accelerator.set_device_index(9)):
        with pytest.raises(RuntimeError, match="does not exist") as raised:
            bad()
        assert isinstance(raised.value, sim.DeviceIndexError)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, device="sim:0") + torch.ones(2, device="sim:1")
    assert tp._C._current_accelerator_device() == torch.device("sim:0")


def test_streams_new_pool_and_priorities() -> None:
    a, b = torch.Stream(device="sim:0"), torch.Stream(device="sim:0")
    assert a != b and a.stream_id != 0 and b.stream_id != 0  # the next streams of the pool
    assert sim._C._sim_stream_priority(torch.Stream(device="sim:0", priority=-1)) == -1
    assert sim._C._sim_stream_priority(torch.Stream(device="sim:0", priority=-100)) == -3  # clamped
    assert sim._C._sim_stream_priority(torch.Stream(device="sim:0", priority=5)) == 0
    low = [sim._C._sim_stream_from_pool(1, False) for _ in range(33)]
    high = [sim._C._sim_stream_from_pool(1, True) for _ in range(32)]
    assert len({s.stream_id for s in low[:32]}) == 32 and low[32] == low[0]  # round robin of 32
    assert not {s.stream_id for s in high} & {s.stream_id for s in low}
    assert all(sim._C._sim_stream_priority(s) < 0 for s in high)
    assert "priority -1" in label(torch.Stream(device="sim:0", priority=-1))
    with pytest.raises(ValueError, match="no stream with id"):
        torch.accelerator.set_stream(torch.Stream(stream_id=10**6, device_index=0,
                                                  device_type=_sim_type()))


def test_torch_stream_draws_from_pools_of_32_like_cuda() -> None:
    """torch.Stream() is getNewStream: as on CUDA, the next stream of the pool of its priority (32
    per priority and device), so the 33rd is the first again and no number of torch.Stream()
    calls grows the checker's clocks. Pipelines get exclusive streams instead."""
    for priority in (0, -1, -3):
        streams = [torch.Stream(device="sim:1", priority=priority) for _ in range(33)]
        assert len({s.stream_id for s in streams[:32]}) == 32 and streams[32] == streams[0]
        assert all(sim._C._sim_stream_priority(s) == priority for s in streams)
        assert all("pool" in label(s) for s in streams)
    ids = {torch.Stream(device="sim:1").stream_id for _ in range(200)}
    assert len(ids) == 32 and 0 not in ids
    live = [tp.Pipeline() for _ in range(3)]
    exclusive = [p.stream("sim:1") for p in live]
    assert not {s.stream_id for s in exclusive} & ids
    assert all("exclusive" in label(s) for s in exclusive)


def test_current_stream_is_per_thread_and_per_device() -> None:
    import threading

    s = torch.Stream(device="sim:0")
    torch.accelerator.set_stream(s)
    seen: Dict[str, Any] = {}

    def other() -> None:
        seen["stream"] = torch.accelerator.current_stream(0)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["stream"] == default_stream(0)
    assert current(0) == s and current(1) == default_stream(1)
    assert sim.current_stream(0) == s


def test_pipeline_streams_on_sim() -> None:
    p = tp.Pipeline()
    s = p.stream("sim:0")
    assert isinstance(s, torch.Stream) and s.device == torch.device("sim:0")
    assert s != current(0)
    assert p.stream() == s  # the current accelerator device is sim:0
    x = torch.ones(N, device="sim:0")
    with p:
        assert torch.accelerator.current_stream() == s
        y = x * 2  # on the pipeline's stream, no wait: a plain PyTorch race
    assert torch.accelerator.current_stream() == default_stream(0)
    found = races_on(x)
    assert found and found[0].later_stream == label(s)
    q = tp.Pipeline()
    assert q.stream("sim:1") != p.stream("sim:1")  # live pipelines never share a stream
    p.synchronize()
    tp.synchronize()
    del y


def test_autograd_on_sim_matches_cpu() -> None:
    torch.manual_seed(0)
    w_cpu = torch.randn(8, 8, requires_grad=True)
    x_cpu = torch.randn(4, 8)
    w = w_cpu.detach().to("sim:0").requires_grad_()
    x = x_cpu.to("sim:0")
    for a, b in ((w_cpu, x_cpu), (w, x)):
        torch.nn.functional.softmax(b @ a, dim=1).log().sum().backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)
    assert sim.races() == []


# ---- results equal CPU results ---------------------------------------------------------------
def _pair(fn: Callable[..., Any], *args: Any) -> None:
    """Runs fn on CPU tensors and on sim copies of them; asserts equal results and inputs."""
    cpu_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    sim_args = [a.to("sim:0") if isinstance(a, torch.Tensor) else a for a in args]
    torch.manual_seed(1)
    expected = fn(*cpu_args)
    torch.manual_seed(1)
    got = fn(*sim_args)
    to_cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    got = torch.utils._pytree.tree_map(to_cpu, got)
    torch.testing.assert_close(got, expected, equal_nan=True, check_device=False)
    torch.testing.assert_close([to_cpu(a) for a in sim_args], cpu_args, check_device=False)


HAND_PICKED: Dict[str, Tuple[Callable[..., Any], Tuple[Any, ...]]] = {
    "add": (lambda a, b: a + b * 2, (torch.randn(5, 4), torch.randn(4))),
    "inplace_on_view": (lambda a: a[1:, ::2].mul_(3).sum(), (torch.randn(4, 6),)),
    "out_resized": (lambda a, b: torch.add(a, b, out=torch.empty(0, device=a.device)),
                    (torch.randn(3, 3), torch.randn(3, 3))),
    "out_same_size": (lambda a: torch.sin(a, out=torch.empty_like(a)), (torch.randn(7),)),
    "matmul": (lambda a, b: a @ b, (torch.randn(5, 3), torch.randn(3, 2))),
    "conv2d": (lambda x, w: torch.nn.functional.conv2d(x, w, padding=1),
               (torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3))),
    "softmax": (lambda a: a.softmax(-1), (torch.randn(3, 5),)),
    "reductions": (lambda a: (a.sum(0), a.mean(), a.max(1), a.cumsum(1), a.std()), (torch.randn(4, 5),)),
    "sort_topk": (lambda a: (a.sort(1), a.topk(2)), (torch.randn(4, 5),)),
    "index": (lambda a, i: (a[i], a.index_select(0, i), a.gather(0, i[:, None].expand(-1, 3))),
              (torch.randn(5, 3), torch.tensor([4, 0, 2]))),
    "index_put": (lambda a, i: a.index_put_((i,), torch.ones(3, 3, device=a.device)),
                  (torch.zeros(5, 3), torch.tensor([1, 3, 4]))),
    "scatter": (lambda a, i: a.scatter_(0, i, 1.0), (torch.zeros(3, 4), torch.tensor([[0, 1, 2, 0]]))),
    "masked": (lambda a: (a.masked_fill(a > 0, 0.0), a[a > 0], a.nonzero()), (torch.randn(4, 4),)),
    "cat_stack": (lambda a, b: (torch.cat([a, b]), torch.stack([a, b], 1)), (torch.randn(2, 3), torch.randn(2, 3))),
    "where_clamp": (lambda a: torch.where(a > 0, a, a.clamp(-0.5)), (torch.randn(6),)),
    "unique": (lambda a: torch.unique(a, return_counts=True), (torch.tensor([3, 1, 3, 2, 1]),)),
    "dtype_and_contiguous": (lambda a: (a.to(torch.float64), a.t().contiguous(), a.int()), (torch.randn(3, 4),)),
    "complex_conj": (lambda a: (a.conj() * 2, a.conj().resolve_conj(), a.abs()),
                     (torch.randn(4, dtype=torch.complex64),)),
    "random": (lambda a: (torch.randn(3, device=a.device), torch.rand_like(a), a.bernoulli()),
               (torch.rand(4),)),
    "factories": (lambda a: (torch.arange(5, device=a.device), torch.linspace(0, 1, 4, device=a.device),
                             torch.eye(3, device=a.device), torch.full((2,), 7.0, device=a.device),
                             torch.zeros_like(a), torch.ones(2, 2, device=a.device)), (torch.rand(2),)),
    "linalg": (lambda a: (torch.linalg.solve(a @ a.T + 3 * torch.eye(3, device=a.device), a),
                          torch.linalg.qr(a)[1].abs()), (torch.randn(3, 3),)),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), (torch.randn(2, 3), torch.randn(3, 4))),
    "embedding_layernorm": (lambda i, w: torch.nn.functional.layer_norm(torch.nn.functional.embedding(i, w), (4,)),
                            (torch.tensor([[0, 2], [1, 1]]), torch.randn(3, 4))),
    "setitem_copy": (lambda a, b: a.__setitem__(slice(1, 3), b) or a, (torch.zeros(4, 2), torch.ones(2, 2))),
    "resize": (lambda a: a.resize_(10).fill_(1.0), (torch.zeros(4),)),
    "sim_to_sim1": (lambda a: a.to("sim:1").mul(2).to(a.device) if a.device.type == "sim" else a.mul(2),
                    (torch.randn(5),)),
}


@pytest.mark.parametrize("name", sorted(HAND_PICKED))
def test_hand_picked_ops_match_cpu(name: str) -> None:
    fn, args = HAND_PICKED[name]
    _pair(fn, *args)
    assert sim.races() == []


def _complex(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.complex64, generator=g)


def _well_conditioned(n: int) -> torch.Tensor:
    return _complex(n, n, seed=7) + 4 * torch.eye(n, dtype=torch.complex64)


def _out_conj(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn(*args, out=o) with o a conjugate view, returning o (its bit and its values)."""
    def run(*args: torch.Tensor) -> torch.Tensor:
        out = torch.empty(args[0].shape, dtype=args[0].dtype, device=args[0].device).conj()
        fn(*args, out=out)
        return out
    return run


# Ops whose kernels see or set the conjugate and negative bits (is_conj(), _neg_view()): on their
# inputs, on out= arguments, and flipped by the kernel itself on its result (linalg_lu_solve and
# linalg_solve with left=False solve for the adjoint in place, then set the result's bit).
MATH_BITS: Dict[str, Tuple[Callable[..., Any], Tuple[torch.Tensor, ...]]] = {
    "lu_solve left=False": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False),
                            (_well_conditioned(3), _complex(2, 3))),
    "lu_solve left=False adjoint": (
        lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False, adjoint=True),
        (_well_conditioned(3), _complex(2, 3))),
    "lu_solve left": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
                      (_well_conditioned(3), _complex(3, 2))),
    "solve left=False": (lambda a, b: torch.linalg.solve(a, b, left=False),
                         (_well_conditioned(3), _complex(2, 3))),
    "solve_triangular left=False": (
        lambda a, b: torch.linalg.solve_triangular(a.triu(), b, upper=True, left=False),
        (_well_conditioned(3), _complex(2, 3))),
    "conj inputs": (lambda a, b: (a.conj() @ b, torch.mm(a.mH, b.conj()), a.conj() * b),
                    (_complex(3, 3), _complex(3, 3, seed=1))),
    "neg view inputs": (lambda a, b: (a._neg_view() + b, torch.mm(a._neg_view(), b)),
                        (_complex(3, 3), _complex(3, 3, seed=1))),
    "out= a conj view": (_out_conj(torch.mul), (_complex(4), _complex(4, seed=1))),
    "out= a conj view, mm": (_out_conj(torch.mm), (_complex(3, 3), _complex(3, 3, seed=1))),
    "lu_solve out= a conj view": (
        lambda a, b: _out_conj(lambda x, out: torch.linalg.lu_solve(
            *torch.linalg.lu_factor(a), x, left=False, out=out))(b),
        (_well_conditioned(3), _complex(2, 3))),
}


@pytest.mark.parametrize("name", sorted(MATH_BITS))
def test_conjugate_and_negative_bits_survive_the_fallback(name: str) -> None:
    """Results equal the CPU's bit for bit, conjugate and negative bits included."""
    fn, args = MATH_BITS[name]
    expected = fn(*[a.clone() for a in args])
    got = fn(*[a.to("sim:0") for a in args])
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    got = list(got) if isinstance(got, tuple) else [got]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert (g.is_conj(), g.is_neg(), g.shape, g.stride()) == \
            (e.is_conj(), e.is_neg(), e.shape, e.stride()), f"{name}: result {i}"
        assert torch.equal(g.resolve_conj().resolve_neg().cpu(), e.resolve_conj().resolve_neg()), \
            f"{name}: result {i} differs"


@pytest.mark.parametrize("fn", ["silu", "mish"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_activation_backward_runs_the_cpu_kernel(fn: str, dtype: torch.dtype) -> None:
    """silu_backward / mish_backward: the CPU's fused kernel, not a decomposition (1 ulp apart)."""
    f = getattr(torch.nn.functional, fn)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = torch.autograd.grad(f(x.requires_grad_()).sum(), x)[0]
    xs = x.detach().to("sim:0").requires_grad_()
    with torch.profiler.profile() as prof:
        got = torch.autograd.grad(f(xs).sum(), xs)[0]
    assert torch.equal(got.cpu(), expected)
    assert f"aten::{fn}_backward" in {e.name for e in prof.events()}
    assert "aten::sigmoid" not in {e.name for e in prof.events()}


# ---- cost ----------------------------------------------------------------------------------------
def _random_program(n_ops: int, seed: int, synchronized: bool, device: str = "sim:0") -> List[torch.Tensor]:
    """A random program over 8 tensors and 3 streams (a single stream on the CPU). With
    `synchronized`, each op's stream first waits for the streams that last used its operands."""
    rng = random.Random(seed)
    on_sim = device.startswith("sim")
    streams: List[Optional[torch.Stream]] = (
        [current(0), torch.Stream(device=device), torch.Stream(device=device)] if on_sim else [None]
    )
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(64, generator=gen).to(device) for _ in range(8)]
    last: List[List[int]] = [[] for _ in xs]  # streams that used each tensor since its last wait
    for _ in range(n_ops):
        si = rng.randrange(3)
        s = streams[si] if on_sim else None
        a, b, k = rng.randrange(8), rng.randrange(8), rng.randrange(5)
        if synchronized and s is not None:
            for j in set(last[a] + last[b]):
                if j != si:
                    s.wait_stream(streams[j])  # type: ignore[arg-type]
            last[a], last[b] = [], []
            xs[a].record_stream(s)  # used on s: kept from reuse until that use completes
            xs[b].record_stream(s)
        with s if s is not None else contextlib.nullcontext():
            if k == 0:
                xs[a] = xs[a] + xs[b]
            elif k == 1:
                xs[a].mul_(0.5).add_(xs[b])
            elif k == 2:
                xs[a] = torch.tanh(xs[b])
            elif k == 3:
                xs[a][::2] = xs[b][1::2]
            else:
                xs[a] = xs[b].flip(0) - 1
        last[a].append(si)
        last[b].append(si)
    if on_sim:
        sim.synchronize(0)
    return [x.cpu() for x in xs]


def test_thousand_op_program_checks_in_under_a_second() -> None:
    _random_program(100, seed=1, synchronized=False)  # warm up
    sim.clear_races()
    start = time.perf_counter()
    _random_program(1000, seed=2, synchronized=False)
    elapsed = time.perf_counter() - start
    assert sim.races(), "an unsynchronized 3-stream program races"
    sim.clear_races()
    start = time.perf_counter()
    _random_program(1000, seed=3, synchronized=True)
    elapsed_sync = time.perf_counter() - start
    print(f"[sim] 1000-op program: {elapsed * 1e3:.0f} ms (racy), {elapsed_sync * 1e3:.0f} ms (synchronized)")
    assert elapsed < 1.0 and elapsed_sync < 1.0


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_synchronized_random_program_is_clean_and_matches_a_serial_cpu_run(seed: int) -> None:
    got = _random_program(300, seed=seed, synchronized=True)
    assert sim.races() == []
    expected = _random_program(300, seed=seed, synchronized=True, device="cpu")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


# ---- the twins of tests/python/test_gpu.py, on the sim device --------------------------------
def test_live_pipelines_never_share_a_sim_stream() -> None:
    live = [tp.Pipeline() for _ in range(40)]  # more than a CUDA-style pool of 32 could keep apart
    streams = [p.stream("sim:0") for p in live]
    assert len({s.stream_id for s in streams}) == 40
    assert all(s.stream_id != 0 for s in streams)  # never the default stream


def test_lifetime_disjoint_pipelines_reuse_the_same_sim_stream() -> None:
    p = tp.Pipeline()
    s = p.stream("sim:0")
    del p
    gc.collect()
    assert tp.Pipeline().stream("sim:0") == s


def test_entering_a_pipeline_switches_the_current_sim_stream() -> None:
    p = tp.Pipeline()
    before = torch.accelerator.current_stream(0)
    with p:
        assert torch.accelerator.current_stream(0) == p.stream("sim:0")
        with tp.default_pipeline():
            assert torch.accelerator.current_stream(0) == before
        assert torch.accelerator.current_stream(0) == p.stream("sim:0")
    assert torch.accelerator.current_stream(0) == before


def test_work_in_a_pipeline_runs_on_its_stream() -> None:
    p = tp.Pipeline()
    x = settled(torch.ones(N, device="sim:0"))
    with p:
        y = x * 3
    sim.synchronize(0)
    assert torch.equal(y.cpu(), torch.full((N,), 3.0))
    assert sim.races() == []


def test_future_wait_orders_the_waiter_after_the_task_stream() -> None:
    sim.set_strict(True)
    p = tp.Pipeline(1)
    out = settled(torch.zeros(N, device="sim:0"))
    p.submit(out.fill_, 7.0).wait()  # the default stream now waits for p's stream
    assert torch.equal((out + 0).cpu(), torch.full((N,), 7.0))
    assert sim.races() == []


def test_reading_a_task_result_without_wait_races() -> None:
    """The twin above fails without the wait: proves it can fail."""
    p = tp.Pipeline(1)
    out = settled(torch.zeros(N, device="sim:0"))
    fut = p.submit(out.fill_, 7.0)
    while not fut.done():
        time.sleep(0.001)
    _ = out + 0  # default stream, not ordered after the task's stream
    found = races_on(out)
    assert found and found[0].earlier_op.startswith("aten::fill_")
    assert found[0].earlier_stream == label(p.stream("sim:0"))


def test_task_streams_wait_for_the_submitter() -> None:
    sim.set_strict(True)
    p = tp.Pipeline(1)
    x = torch.zeros(N, device="sim:0")
    x.fill_(3.0)  # queued on the default stream; the task reads it on p's stream
    total = p.submit(lambda: x.sum()).wait()
    assert total.item() == 3.0 * N
    assert sim.races() == []


def test_events_and_wait_pipeline_order_two_pipelines() -> None:
    sim.set_strict(True)
    a, b = tp.Pipeline(), tp.Pipeline()
    x = settled(torch.zeros(N, device="sim:0"))
    with a:
        x.fill_(1.0)
    b.wait_pipeline(a)
    with b:
        y = x * 2
    b.synchronize()
    assert torch.equal(y.cpu(), torch.full((N,), 2.0))
    ev = a.record_event(tp.PipelineEvent())
    assert torch.device("sim", 0) in ev.devices  # plus any device a's slot used before
    ev.synchronize()
    assert ev.query()
    assert sim.races() == []


def test_pipeline_event_elapsed_time_to_itself() -> None:
    ev = tp.PipelineEvent(enable_timing=True)
    with pytest.raises(ValueError, match="not recorded on sim:0"):
        ev.elapsed_time(ev, "sim:0")
    tp.Pipeline().record_event(ev)
    assert ev.elapsed_time(ev, "sim:0") == 0.0


def test_two_pipelines_without_a_wait_race() -> None:
    a, b = tp.Pipeline(), tp.Pipeline()
    x = settled(torch.zeros(N, device="sim:0"))
    with a:
        x.fill_(1.0)
    with b:
        _ = x * 2
    found = races_on(x)
    assert found and found[0].earlier_stream == label(a.stream("sim:0"))
    assert found[0].later_stream == label(b.stream("sim:0"))


# ---- process-level behaviour (fresh interpreters) ----------------------------------------------
def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TORCH_PIPELINE_SIM_TEST_CHILD", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_nothing_is_registered_before_enable() -> None:
    proc = _run_python("""
        import torch, torch_pipeline.sim as sim, oneflow_pipeline.sim as alias
        assert torch._C._get_privateuse1_backend_name() == "privateuseone"
        assert not hasattr(torch, "sim") and not sim.is_enabled() and sim.device_count() == 0
        acc = torch.accelerator.current_accelerator()
        assert acc is None or acc.type == "cuda"  # a CUDA build names CUDA even without a GPU
        assert alias.enable is sim.enable
        try:
            sim.synchronize()
        except RuntimeError as e:
            assert "enable" in str(e)
        else:
            raise AssertionError("synchronize before enable")
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_enable_refuses_a_privateuse1_backend_of_another_name() -> None:
    proc = _run_python("""
        import torch, torch_pipeline.sim as sim
        torch.utils.rename_privateuse1_backend("foo")
        try:
            sim.enable()
        except RuntimeError as e:
            assert "'foo'" in str(e), e
            print("refused")
    """)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr


def test_script_ending_right_after_a_sim_backward_exits_cleanly() -> None:
    proc = _run_python("""
        import torch, torch_pipeline.sim as sim
        sim.enable(num_devices=2)
        w = torch.randn(3, 3, device="sim:1", requires_grad=True)
        (w * 2).sum().backward()
        print("done")
    """)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr


# ---- running this module in a child process ------------------------------------------------------
install_proxies(globals(), __file__)
