"""The sim device's asynchronous mode and latency model (docs/design.md,
"Asynchronous mode and the latency model") on the sim device.

Each stream runs its kernels on a thread of its own, a modelled time after they were queued, so a
missing wait gives WRONG values, deterministically: the tests give the producer (or the slow
reader) a latency of tens of milliseconds, which opens the race window every time. Each program
runs tracked (values bit-equal to the synchronous run, no race) and untracked (wrong values, and
the race checker still reports the race). Then: events and synchronize, non_blocking copies to the
host, memory reuse by the caching allocator, kernel errors reported at the next synchronizing call,
ops without meta kernels, the streams' threads at exit and after fork().

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from _programs import make_pipelines, make_program, run_program
    from torch_pipeline import _C

N = 4096
SLOW_MS = 30  # the latency that opens race windows


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


@pytest.fixture(autouse=True)
def _asynchronous(_fresh_state: None) -> Iterator[None]:
    if not IN_CHILD:
        yield
        return
    sim.set_asynchronous(True)
    sim.clear_latency()
    (ones() * 2).sum().item()  # the first meta computation of the process is slow (lazy init)
    yield
    sim.clear_latency()
    sim.set_asynchronous(True)
    torch.accelerator.synchronize()


def ones(value: float = 1.0, device: str = "sim:0") -> "torch.Tensor":
    return torch.full((N,), value, device=device)


def slow(op: str, ms: float = SLOW_MS) -> None:
    sim.set_latency(op=op, us=ms * 1000)


def synchronous(fn):  # type: ignore[no-untyped-def]
    """fn() run in synchronous mode (the reference), then back to asynchronous mode."""
    sim.set_asynchronous(False)
    try:
        return fn()
    finally:
        sim.set_asynchronous(True)


# ---- ops are queued; the host waits where CUDA's does ------------------------------------------
def test_ops_return_before_their_kernels_run_and_host_reads_wait() -> None:
    x = ones(3.0)
    torch.accelerator.synchronize()
    slow("aten::mul.out", 100)
    start = time.perf_counter()
    y = x * 2
    queued = time.perf_counter() - start
    assert queued < 0.05, f"the op waited for its kernel ({queued:.3f} s)"
    assert y.sum().item() == 6.0 * N          # .item() waits for the stream
    assert time.perf_counter() - start >= 0.1
    z = x * 4
    assert torch.equal(z.cpu(), torch.full((N,), 12.0))  # a blocking copy waits
    slow("aten::mul.out", 50)
    w = x * 5
    assert "30." not in repr(w) and "15." in repr(w)      # printing reads the values


def test_events_and_synchronize_behave_like_cuda() -> None:
    x = ones()
    slow("aten::mul.out", 60)
    s = torch.Stream(device="sim:0")
    start_ev = torch.Event(enable_timing=True)
    end_ev = torch.Event(enable_timing=True)
    start_ev.record()
    y = x * 2
    end_ev.record()
    assert not end_ev.query()
    assert not torch.accelerator.current_stream().query()
    assert s.query()                           # nothing queued there
    end_ev.synchronize()
    assert end_ev.query()
    assert torch.accelerator.current_stream().query()
    assert start_ev.elapsed_time(end_ev) >= 50.0   # modelled device time, in ms
    # A stream waiting for an event: the wait is queued, the host returns at once.
    e = torch.Event()
    y = x * 3
    e.record()
    with s:
        s.wait_event(e)
        z = y + 1
    s.synchronize()
    assert torch.equal(z.cpu(), torch.full((N,), 4.0))
    # Device synchronize waits for every stream of the device.
    with s:
        w = x * 7
    torch.accelerator.synchronize()
    assert s.query()
    sim.set_asynchronous(False)                 # no latency needed to read w now
    assert torch.equal(w.cpu(), torch.full((N,), 7.0))


def test_two_streams_overlap_in_time() -> None:
    x = ones()
    torch.accelerator.synchronize()
    slow("aten::mul.out", 80)
    s1, s2 = torch.Stream(device="sim:0"), torch.Stream(device="sim:0")
    start = time.perf_counter()
    with s1:
        a = x * 2
    with s2:
        b = x * 3
    torch.accelerator.synchronize()
    both = time.perf_counter() - start
    start = time.perf_counter()
    with s1:
        a = x * 2
        b = x * 3
    s1.synchronize()
    one = time.perf_counter() - start
    assert both < 0.15 <= one, (both, one)
    assert a.sum().item() == 2.0 * N and b.sum().item() == 3.0 * N


# ---- untracked twins give wrong values; tracked programs equal the synchronous run --------------
def read_after_write(p: "tp.Pipeline") -> "torch.Tensor":
    x = ones()
    y = x * 3                  # written on the default stream, late (the producer is slow)
    with tp.pipeline(p):
        return y + 1           # read on p's stream


def write_after_read(p: "tp.Pipeline") -> Tuple["torch.Tensor", "torch.Tensor"]:
    x = ones()
    torch.accelerator.synchronize()
    with tp.pipeline(p):
        a = x * 2              # reads x on p's stream, late (the reader is slow)
    x.fill_(7)                 # written on the default stream at once
    return a, x


def write_after_write(p: "tp.Pipeline") -> "torch.Tensor":
    x = ones()
    with tp.pipeline(p):
        x.mul_(5)              # written on p, late
    x.add_(1)                  # written on the default stream
    return x


def read_through_its_storage(p: "tp.Pipeline") -> "torch.Tensor":
    x = ones()
    y = x * 3                  # written on the default stream, late
    with tp.pipeline(p):       # the same memory, reached through its Storage (torch.load does it)
        alias = torch.empty(0, device="sim:0").set_(y.untyped_storage())
        return alias + 1       # read on p's stream


def write_through_its_storage(p: "tp.Pipeline") -> Tuple["torch.Tensor", "torch.Tensor"]:
    x = ones()
    torch.accelerator.synchronize()
    with tp.pipeline(p):
        a = x * 2              # reads x on p's stream, late
    x.untyped_storage().fill_(0)   # written on the default stream (set_ and fill_ inside)
    return a, x


def read_after_a_resize_elsewhere(p: "tp.Pipeline") -> Tuple["torch.Tensor", "torch.Tensor"]:
    x = torch.zeros(16, device="sim:0")   # allocated on the default stream
    with tp.pipeline(p):
        x.resize_(N)           # new memory, allocated on p's stream: its new home
        x.fill_(2.0)
    y = x * 3                  # read on the default stream, late: off x's new home
    del x                      # x's block goes back to p's stream's pool ...
    with tp.pipeline(p):
        z = ones(-1.0)         # ... where the next allocation takes it, written at once
    return y, z


def read_after_a_storage_regrown_elsewhere(p: "tp.Pipeline") -> Tuple["torch.Tensor", "torch.Tensor"]:
    # compiled FSDP2's free_storage / alloc_storage: resize_storage_bytes_ to 0 and back
    x = torch.zeros(N, device="sim:0")    # allocated on the default stream
    torch.ops.inductor.resize_storage_bytes_(x, 0)          # freed there
    with tp.pipeline(p):
        torch.ops.inductor.resize_storage_bytes_(x, N * 4)  # new memory, from p's stream's pool
        x.fill_(2.0)
    torch.accelerator.synchronize()  # (nothing of p's pending: only the home decides now)
    y = x * 3                  # read on the default stream, late: off x's new home
    del x                      # its block goes back to p's stream's pool ...
    with tp.pipeline(p):
        z = ones(-1.0)         # ... where the next allocation takes it, written at once
    return y, z


def read_after_an_out_resize_elsewhere(p: "tp.Pipeline") -> Tuple["torch.Tensor", "torch.Tensor"]:
    # sort's outs are named values= and indices= (not out=): resized inside the op all the same
    values = torch.zeros(16, device="sim:0")              # allocated on the default stream
    indices = torch.zeros(16, dtype=torch.long, device="sim:0")
    src = ones(1.0)
    with tp.pipeline(p):
        torch.sort(src, out=(values, indices))  # new memory, allocated on p's stream
        values.fill_(2.0)
    y = values * 3             # read on the default stream, late: off values' new home
    del values                 # its block goes back to p's stream's pool ...
    with tp.pipeline(p):
        z = ones(-1.0)         # ... where the next allocation takes it, written at once
    return y, z


PROGRAMS = {
    "read_after_write": (read_after_write, "aten::mul.out"),
    "write_after_read": (write_after_read, "aten::mul.out"),
    "write_after_write": (write_after_write, "aten::mul.out"),
    "read_through_its_storage": (read_through_its_storage, "aten::mul.out"),
    "write_through_its_storage": (write_through_its_storage, "aten::mul.out"),
    "read_after_a_resize_elsewhere": (read_after_a_resize_elsewhere, "aten::mul.out"),
    "read_after_an_out_resize_elsewhere": (read_after_an_out_resize_elsewhere, "aten::mul.out"),
    "read_after_a_storage_regrown_elsewhere": (read_after_a_storage_regrown_elsewhere,
                                               "aten::mul.out"),
}


def values(out: object) -> List["torch.Tensor"]:
    outs = out if isinstance(out, tuple) else (out,)
    torch.accelerator.synchronize()
    return [t.cpu() for t in outs]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_untracked_twins_give_wrong_values_and_tracked_programs_do_not(name: str) -> None:
    program, slow_op = PROGRAMS[name]
    p = tp.Pipeline()
    reference = synchronous(lambda: values(program(p)))
    slow(slow_op)
    tracked = values(program(p))
    assert all(torch.equal(r, t) for r, t in zip(reference, tracked)), (reference, tracked)
    assert sim.races() == []
    with untracked():
        # The blocks the program will be given hold other values now (blocks the tracked run kept
        # alive went back to the allocator when tracking stopped): a stale read cannot see the
        # right values a previous run left in a reused block.
        torch.accelerator.synchronize()
        junk = [torch.full((N,), -1.0, device="sim:0") for _ in range(8)]
        torch.accelerator.synchronize()
        del junk
        wrong = values(program(p))
        assert not all(torch.equal(r, w) for r, w in zip(reference, wrong)), \
            "the untracked program computed the right values: no race window opened"
        assert sim.races(), "the race checker missed the race"


def test_cpu_read_of_a_pending_non_blocking_copy() -> None:
    p = tp.Pipeline()
    slow("aten::mul.out")

    def program() -> float:
        with tp.pipeline(p):
            y = ones(2.0) * 4
            host = y.to("cpu", non_blocking=True)   # returns at once: the copy follows the mul
        assert host.is_pinned()
        return float(host.sum())                    # a CPU op reading the copy's result

    assert program() == 8.0 * N                     # tracked: the host waits for the copy
    # The host allocator caches the freed block, with the right answer in it: the next pinned
    # block of that size gets -1s first (LIFO), so that a read before the copy shows.
    torch.empty(N, pin_memory=True).fill_(-1.0)
    with untracked():
        stale = program()
        assert stale != 8.0 * N, "the CPU read saw the copy's result without a wait"
        torch.accelerator.synchronize()
        assert any(r.later_op.endswith("(host)") for r in sim.races()), sim.races()


def nested_halves(buffer: "torch.Tensor") -> "torch.Tensor":
    """A nested tensor (NestedTensorImpl, as the transformer fast path makes) of two rows over the
    memory of the 1-d CPU tensor `buffer`: its buffer is `buffer`'s storage."""
    n = buffer.numel() // 2
    nt = torch._nested_view_from_buffer(
        buffer, torch.tensor([[n], [n]]), torch.tensor([[1], [1]]), torch.tensor([0, n]))
    assert nt.is_nested and nt.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return nt


def test_cpu_ops_on_nested_views_of_pinned_memory_a_pending_copy_uses() -> None:
    """The tracker follows a nested tensor to its buffer, which is its storage: a CPU op reading a
    nested view of the result of a pending non_blocking copy to the host waits for the copy, and
    one writing a nested view of the source of a pending copy from the host waits before it
    writes. Untracked, both see the race window (wrong values) and the race checker reports the
    nested tensor's host access (its whole buffer)."""
    p = tp.Pipeline()
    waited: List[int] = []

    def read() -> float:
        slow("aten::mul.out")
        host = torch.zeros(N).pin_memory()                 # (zeros until the copy lands)
        with tp.pipeline(p):
            y = ones(2.0) * 4
            host.copy_(y, non_blocking=True)               # lands SLOW_MS later
        nt = nested_halves(host)                           # a view: nothing waits yet
        waits = tp.tracking_stats()["host_waits"]
        total = float(torch.nested.to_padded_tensor(nt, 0.0).sum())
        waited.append(tp.tracking_stats()["host_waits"] - waits)
        return total

    def write() -> Tuple[float, float]:
        slow("aten::copy_ (cpu -> sim:0) non_blocking")
        src = torch.ones(N).pin_memory()
        with tp.pipeline(p):
            back = src.to("sim:0", non_blocking=True)      # reads src SLOW_MS later
        nested_halves(src).mul_(2)                         # a CPU write of src's buffer
        torch.accelerator.synchronize()
        return back.sum().item(), src.sum().item()

    assert read() == 8.0 * N and waited == [1]            # the nested op waited, on its buffer
    assert write() == (1.0 * N, 2.0 * N)
    assert sim.races() == []
    for program, right, host_op in ((read, 8.0 * N, "aten::nested_to_padded_tensor"),
                                    (write, (1.0 * N, 2.0 * N), "aten::mul_")):
        with untracked():
            assert program() != right, "the CPU op ran inside the copy's window"
            torch.accelerator.synchronize()
            found = [r for r in sim.races() if r.later_stream == "host"]
            assert found and found[0].later_op.startswith(host_op), sim.races()
            assert "pinned host memory" in found[0].memory
            sim.clear_races()


def test_non_blocking_copies_from_the_host() -> None:
    """From pageable memory the source is staged when the copy is issued (the host may reuse it
    at once); from pinned memory the copy reads it when it runs, so an untracked host write
    before then changes what arrives, and a tracked one waits for the copy."""
    slow("aten::copy_ (cpu -> sim:0) non_blocking")
    pageable = torch.ones(N)
    y = pageable.to("sim:0", non_blocking=True)
    pageable.fill_(5.0)
    assert torch.equal(y.cpu(), torch.full((N,), 1.0))
    p = tp.Pipeline()

    def program() -> "torch.Tensor":
        pinned = torch.ones(N).pin_memory()
        with tp.pipeline(p):
            back = pinned.to("sim:0", non_blocking=True)   # reads pinned on p's stream, late
        pinned.fill_(2.0)                                  # a CPU write while the copy is queued
        torch.accelerator.synchronize()
        return back

    assert torch.equal(program().cpu(), torch.full((N,), 1.0))
    with untracked():
        assert torch.equal(program().cpu(), torch.full((N,), 2.0))


def test_a_pinned_block_is_not_handed_out_again_while_a_queued_copy_reads_it() -> None:
    """The caching host allocator hands freed pinned blocks out again, but not one that a queued
    non_blocking copy still reads: the copy holds its host tensor until it ran (CUDA's allocator
    waits for the copy's event), so a pinned tensor made and written meanwhile gets another
    block, and the copy delivers what the old one held."""
    slow("aten::copy_ (cpu -> sim:0) non_blocking")
    sim.empty_host_cache()
    src = torch.ones(N).pin_memory()
    ptr = src.data_ptr()
    y = src.to("sim:0", non_blocking=True)  # runs SLOW_MS later
    del src
    other = torch.empty(N, pin_memory=True)
    other.fill_(5.0)
    assert other.data_ptr() != ptr
    assert torch.equal(y.cpu(), torch.ones(N))
    del other
    torch.accelerator.synchronize()
    made = sim.host_memory_stats()["num_host_alloc"]
    again = torch.empty(N, pin_memory=True)  # a cached block
    assert sim.host_memory_stats()["num_host_alloc"] == made and again.is_pinned()


@pytest.mark.parametrize("safety", ["keep_alive", "record_stream"])
def test_memory_freed_after_a_cross_stream_use(safety: str) -> None:
    p = tp.Pipeline()
    _C._set_allocator_safety(safety)

    def program() -> "torch.Tensor":
        x = ones(1.0)              # allocated on the default stream
        torch.accelerator.synchronize()
        with tp.pipeline(p):
            y = x * 2              # reads x on p's stream, late
        del x                      # the block goes back to the default stream's pool
        z = ones(5.0)              # a new allocation there may reuse it, written at once
        return y, z

    try:
        y, z = program()
        assert torch.equal(values(y)[0], torch.full((N,), 2.0))  # (fast: no latency needed)
        slow("aten::mul.out")
        y, z = program()
        assert torch.equal(values(y)[0], torch.full((N,), 2.0))
        assert sim.races() == []
        with untracked():
            y, z = program()
            assert torch.equal(values(y)[0], torch.full((N,), 10.0)), \
                "the reused block was not overwritten under the pending read"
            assert sim.races()
    finally:
        _C._set_allocator_safety("keep_alive")


def test_a_block_filled_on_another_stream_goes_back_once_its_own_stream_waited() -> None:
    """A block allocated on the default stream, written (slowly) on p's stream, then read on the
    default stream: the read waits for the write, and the allocator hands the block out again only
    to later work of the default stream, which comes after that wait. So it goes back to the
    allocator when its reader drops it, not when a later poll sees the slow write done: keeping it
    until then held every such block while the host ran ahead (tp.offload's copies back grew
    device memory with the host's lead)."""
    p = tp.Pipeline()
    slow("aten::mul_.Tensor", ms=20)
    outs = []
    torch.accelerator.synchronize()
    base = torch.accelerator.memory_allocated(0)
    for i in range(12):
        buf = ones(float(i))               # allocated on the default stream
        with tp.pipeline(p):
            buf.mul_(torch.tensor(2.0))    # written on p's stream, 20 ms late
        outs.append((buf + 1).sum())       # read on the default stream: waits for the write
        del buf
        assert tp.tracking_stats()["kept_alive"] == 0, "the block is still kept alive"
    # (at most a few blocks of N floats at once: the buffer, the sum's input, the sums)
    assert torch.accelerator.memory_allocated(0) - base <= 4 * N * 4
    assert [o.item() for o in outs] == [float((2 * i + 1) * N) for i in range(12)]
    assert sim.races() == []


def test_a_block_a_task_wrote_goes_back_once_its_future_was_waited() -> None:
    """The same through an external wait: a task writes (slowly) a block its submitter allocated;
    waiting for the task's future orders the submitter's stream after the write, so the block
    is not kept alive past that."""
    p = tp.Pipeline()
    slow("aten::mul_.Tensor", ms=20)
    torch.accelerator.synchronize()
    for i in range(4):
        buf = ones(float(i))
        p.submit(lambda b: b.mul_(torch.tensor(2.0)), buf).wait()
        assert tp.tracking_stats()["kept_alive"] == 0, "the block is still kept alive"
        assert buf.sum().item() == float(2 * i * N)
        del buf
    assert sim.races() == []


def _free_storage(w: "torch.Tensor", x: "torch.Tensor") -> "torch.Tensor":
    y = x + 1
    w.untyped_storage().resize_(0)  # FSDP2's free_storage; Dynamo: inductor::resize_storage_bytes_
    return y


FREES = {
    "the dispatcher op": lambda w, x: torch.ops.inductor.resize_storage_bytes_(w, 0),
    "inside a compiled region": torch.compile(_free_storage, backend="aot_eager", fullgraph=True),
}


@pytest.mark.parametrize("how", list(FREES))
def test_a_storage_freed_by_resize_storage_bytes_is_not_reused_early(how: str) -> None:
    """Compiled FSDP2 frees a parameter's memory with inductor::resize_storage_bytes_, inside the
    compiled region (its schema declares no write). w (the default stream's block) is read late
    on p1 and freed on p2: its block goes back to the default stream's pool at once, and the
    default stream's next allocation would take it under p1's read, unless the resize is seen as
    a write that may move the storage (its block recorded on p2, which waits for the read)."""
    p1, p2 = tp.Pipeline(), tp.Pipeline()
    free = FREES[how]

    def program() -> Tuple["torch.Tensor", "torch.Tensor"]:
        w = ones(1.0)
        x = ones(3.0)
        torch.accelerator.synchronize()
        with tp.pipeline(p1):
            y = w * 2          # reads w on p1, late
        with tp.pipeline(p2):
            free(w, x)         # frees w's block (to the default stream's pool)
        z = ones(5.0)          # the default stream's next block of this size
        return y, z

    program()                  # (compiled here, before the race window opens)
    torch.accelerator.synchronize()
    sim.clear_races()
    slow("aten::mul.out")
    got = values(program())
    assert [float(t[0]) for t in got] == [2.0, 5.0]
    assert sim.races() == []
    with untracked():
        program()
        torch.accelerator.synchronize()
        assert sim.races(), "the untracked twin did not race"


def test_the_old_block_of_a_storage_resized_off_its_home_is_not_reused_early() -> None:
    """x (the default stream's block) is read late on p1 and then resized on p2: the resize waits
    for the read and copies the old bytes on p2, and frees the old block, inside the op, to the
    default stream's pool. Keeping x alive keeps the storage, not that block: the default stream's
    next allocation would take it while p2's copy (and p1's read, which it waits for) are still
    queued, unless the block is recorded on p2."""
    p1, p2 = tp.Pipeline(), tp.Pipeline()
    slow("aten::mul.out")

    def program() -> Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
        x = ones(1.0)
        torch.accelerator.synchronize()
        with tp.pipeline(p1):
            y = x * 2          # reads x on p1, late
        with tp.pipeline(p2):
            x.resize_(2 * N)   # reallocates on p2 (old bytes copied there)
        z = ones(5.0)          # the default stream's next block of this size
        return y, x[:N], z

    got = values(program())
    assert [float(t[0]) for t in got] == [2.0, 1.0, 5.0]
    assert sim.races() == []
    with untracked():
        program()
        torch.accelerator.synchronize()
        assert sim.races(), "the untracked twin did not race"


def test_an_out_argument_of_size_zero_is_defined_by_the_op_that_allocates_it() -> None:
    """torch.cat(out=) into a tensor of size 0 allocates it inside the op on p's stream: it is the
    op's argument coming back, and yet fresh memory that op wrote, which a reader on another stream
    must wait for."""
    p = tp.Pipeline()

    def program() -> "torch.Tensor":
        a, b = ones(1.0), ones(2.0)
        out = torch.empty(0, device="sim:0")
        with tp.pipeline(p):
            torch.cat([a, b], out=out)     # out's memory allocated and written on p
        return out.sum()                   # read on the default stream

    assert values(program())[0].item() == 3.0 * N
    assert sim.races() == []
    with untracked():
        program()
        torch.accelerator.synchronize()
        assert sim.races(), "the untracked twin did not race"


def test_storage_resize_frees_and_allocates_like_an_op() -> None:
    """UntypedStorage.resize_ (FSDP's free_storage / alloc_storage) is no dispatcher op: freeing x's
    memory while p still reads it, then allocating again on p and reading it on the default
    stream, must not hand a block out under a pending use."""
    p = tp.Pipeline()
    slow("aten::mul.out")

    def program() -> List["torch.Tensor"]:
        x = ones(1.0)
        torch.accelerator.synchronize()
        with tp.pipeline(p):
            y = x * 2                            # reads x on p, late
        x.untyped_storage().resize_(0)           # frees it on the default stream
        z = ones(5.0)                            # the default stream's next block of this size
        with tp.pipeline(p):
            x.untyped_storage().resize_(N * 4)   # allocated again, on p's stream
            x.fill_(3.0)
        w = x * 2                                # read on the default stream, late
        del x                                    # back to p's pool ...
        with tp.pipeline(p):
            v = ones(-1.0)                       # ... and taken at once
        return [y, z, w, v]

    got = values(tuple(program()))
    assert [float(t[0]) for t in got] == [2.0, 5.0, 6.0, -1.0]
    assert sim.races() == []
    with untracked():
        program()
        torch.accelerator.synchronize()
        assert sim.races(), "the untracked twin did not race"


def test_tracked_random_programs_equal_the_synchronous_run() -> None:
    import random
    rng = random.Random(7)
    devices = ["sim:0", "sim:1"]
    wrong = 0
    for n in range(12):
        program = make_program(rng, length=16)
        pipelines = make_pipelines(rng)
        sim.clear_latency()
        reference = synchronous(lambda: run_program(program, [None] * 4, n, devices))
        sim.set_latency(launch_us=1500)
        got = run_program(program, pipelines, n, devices)
        assert all(torch.equal(r, g) for r, g in zip(reference, got)), f"program {n}: {program}"
        assert sim.races() == []
        with untracked():
            twin = run_program(program, pipelines, n, devices)
            for d in devices:              # the twin's unordered uses end here
                sim.synchronize(d)
            wrong += not all(torch.equal(r, g) for r, g in zip(reference, twin))
        sim.clear_races()
        sim.set_strict(True)
    assert wrong > 0, "no untracked program computed a wrong value"


def _trains_as_synchronously(make_model: Callable[[], "torch.nn.Module"], batch: Tuple[int, ...],
                             classes: int, steps: int, launch_us: float) -> None:
    """SGD with momentum in a pipeline, every kernel `launch_us`: the same losses and state (weights,
    batch-norm statistics), bit for bit, as the synchronous run."""
    def train() -> Tuple[List[float], List["torch.Tensor"]]:
        torch.manual_seed(0)
        model = make_model().to("sim:0")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        p = tp.Pipeline()
        losses = []
        for _ in range(steps):
            x = torch.randn(*batch).to("sim:0")
            y = torch.randint(0, classes, (batch[0],)).to("sim:0")
            with tp.pipeline(p):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses, [t.detach().cpu() for t in model.state_dict().values()]

    ref_losses, ref_state = synchronous(train)
    sim.set_latency(launch_us=launch_us)
    losses, state = train()
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(ref_state, state))
    assert sim.races() == []


def test_a_tracked_training_step_equals_the_synchronous_run() -> None:
    """Forward, backward (the autograd engine's device thread queues the backward kernels) and SGD
    with momentum in a pipeline, every kernel 300 us: the same losses and weights, bit for bit."""
    import torch.nn as nn

    _trains_as_synchronously(lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64),
                                                   nn.Linear(64, 10)),
                             batch=(16, 32), classes=10, steps=3, launch_us=300)


def test_queued_results_have_the_layout_and_values_of_the_synchronous_run() -> None:
    """The output metadata of queued ops is cached per call key: calls that differ only in an int
    argument, a Scalar's type, strides or dtype get their own layouts."""
    a = torch.arange(12, device="sim:0").reshape(3, 4)
    f = a.float()
    cases = [
        lambda: a.sum(0), lambda: a.sum(1), lambda: a + 1, lambda: a + 0.5, lambda: a * True,
        lambda: f.t() * 2, lambda: f * 2, lambda: f.t().contiguous(), lambda: f.half() + 1,
        lambda: torch.cat([a, a], 0), lambda: torch.cat([a, a], 1), lambda: f.mean([0, 1]),
        lambda: a.repeat(2, 1), lambda: a.repeat(1, 3), lambda: f.view(4, 3) @ f,
        lambda: torch.stack([f, f * 2]).max(0),
        lambda: (lambda g: g[:, :2].add_(g[:, 2:]))(f.clone()),
        lambda: f.narrow_copy(1, 0, 2), lambda: f.narrow_copy(1, 1, 3),
        lambda: torch.nn.functional.pad(f, (1, 1)), lambda: torch.nn.functional.pad(f, (2, 0, 1, 0)),
    ]
    def run() -> List["torch.Tensor"]:
        out = []
        for case in cases * 2:   # the second round uses the cached plans
            r = case()
            out.extend(r if isinstance(r, tuple) else (r,))
        return out

    async_results = run()
    reference = synchronous(run)
    for i, (x, r) in enumerate(zip(async_results, reference)):
        assert (x.dtype, x.shape, x.stride()) == (r.dtype, r.shape, r.stride()), i
        assert torch.equal(x.cpu(), r.cpu()), i


# ---- optional outputs and inputs ------------------------------------------------------------------
# Ops whose outputs are undefined where their output_mask says False (a conv without bias, a norm
# without affine parameters, an input that does not require grad), and ops whose optional inputs
# are absent. Each case: (ops to run, on tensors of `device`) -> results; run on the CPU and twice
# on the asynchronous sim (the first call checks the plan against the CPU kernel, the second is
# queued: Note [A plan is checked against the CPU kernel once]).
def _bn_stats(x: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    return mean, invstd


def _optional_output_cases() -> Dict[str, Tuple[Callable[..., Any], int]]:
    """name -> (fn(tensors, mask) -> results, mask length); tensors: a dict of CPU tensors that
    fn receives copied to the device under test."""
    aten = torch.ops.aten
    cases: Dict[str, Tuple[Callable[..., Any], int]] = {
        "convolution_backward": (lambda t, m: aten.convolution_backward(
            t["go4"], t["x6"], t["w3"], [3], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, m), 3),
        "convolution_backward transposed": (lambda t, m: aten.convolution_backward(
            t["x6"], t["go4"], t["w3"], [2], [1, 1], [0, 0], [1, 1], True, [0, 0], 1, m), 3),
        "native_batch_norm_backward": (lambda t, m: aten.native_batch_norm_backward(
            t["x6"], t["x6"] * 2, t["c2"], None, None, *_bn_stats(t["x6"] * 2), True, 1e-5, m), 3),
        "native_batch_norm_backward eval": (lambda t, m: aten.native_batch_norm_backward(
            t["x6"], t["x6"] * 2, t["c2"], t["c2"] * 0.1, t["c2"].abs() + 1, None, None, False,
            1e-5, m), 3),
        "native_layer_norm_backward": (lambda t, m: aten.native_layer_norm_backward(
            t["x6"], t["x6"] * 2, [6], *aten.native_layer_norm(t["x6"] * 2, [6], None, None, 1e-5)[1:],
            t["c6"], t["c6"] + 1, m), 3),
        "native_layer_norm_backward without weight": (lambda t, m: aten.native_layer_norm_backward(
            t["x6"], t["x6"] * 2, [6], *aten.native_layer_norm(t["x6"] * 2, [6], None, None, 1e-5)[1:],
            None, None, m + [False, False]), 1),  # no weight, no bias: no gradients for them
        "native_group_norm_backward": (lambda t, m: aten.native_group_norm_backward(
            t["x6"], t["x6"] * 2, *aten.native_group_norm(t["x6"] * 2, None, None, 1, 2, 36, 1, 1e-5)[1:],
            t["c2"], 1, 2, 36, 1, m), 3),
        "grid_sampler_2d_backward": (lambda t, m: aten.grid_sampler_2d_backward(
            t["go4"][:, :2], t["x6"], t["grid"], 0, 0, False, m), 2),
        "_slow_conv2d_backward": (lambda t, m: aten._slow_conv2d_backward.output_mask(
            t["go4"], t["x6"], t["w3"], [3, 3], [1, 1], [0, 0], m), 3),
    }
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm_backward", "CPU"):
        cases["_fused_rms_norm_backward"] = (lambda t, m: aten._fused_rms_norm_backward(
            t["x6"], t["x6"] * 2, [6], aten._fused_rms_norm(t["x6"] * 2, [6], t["c6"], 1e-5)[1],
            t["c6"], m), 2)
    return cases


def _optional_tensors() -> Dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(0)
    return {"x6": torch.randn(1, 2, 6, 6, generator=g), "go4": torch.randn(1, 3, 4, 4, generator=g),
            "w3": torch.randn(3, 2, 3, 3, generator=g), "c2": torch.randn(2, generator=g),
            "c6": torch.randn(6, generator=g), "grid": torch.rand(1, 4, 4, 2, generator=g) * 2 - 1}


def _same_results(got: Any, expected: Any) -> None:
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        if b is None:
            assert a is None, f"result {i}: the CPU gives None (undefined), sim {a}"
            continue
        assert a is not None, f"result {i}: sim gives None, the CPU a tensor"
        assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), i
        assert torch.equal(a.cpu(), b), f"result {i} differs"


@pytest.mark.parametrize("name", sorted(_optional_output_cases()))
def test_ops_with_optional_outputs_queue_like_the_cpu_for_every_mask(name: str) -> None:
    """Every output_mask combination: the undefined outputs stay undefined (not None), the
    defined ones equal the CPU's, on the checking call and on the queued one."""
    import itertools

    fn, n = _optional_output_cases()[name]
    cpu = _optional_tensors()
    dev = {k: v.to("sim:0") for k, v in cpu.items()}
    sim.set_latency(launch_us=200)
    for mask in itertools.product([True, False], repeat=n):
        expected = fn(cpu, list(mask))
        first = fn(dev, list(mask))    # run at once: its plan is checked
        second = fn(dev, list(mask))   # queued
        _same_results(first, expected)
        _same_results(second, expected)
    assert sim.races() == []


def _embedding_bag(w: "torch.Tensor", mode: str, weighted: bool) -> "torch.Tensor":
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9], device=w.device)
    offsets = torch.tensor([0, 4], device=w.device)
    psw = torch.arange(8.0, device=w.device) / 8 if weighted else None
    return torch.nn.functional.embedding_bag(idx, w, offsets, mode=mode, per_sample_weights=psw)


# name -> fn(device) -> (loss, tensors whose gradients are compared): ops with absent optional
# inputs, and modules whose backward has masked-off outputs.
def _module_cases() -> Dict[str, Callable[[str], Tuple["torch.Tensor", List["torch.Tensor"]]]]:
    import torch.nn as nn
    import torch.nn.functional as F

    def params(make: Callable[[], "nn.Module"], device: str) -> "nn.Module":
        torch.manual_seed(0)
        return make().to(device)

    def conv(device: str) -> Any:  # the first conv of every ResNet: no bias, input without grad
        c = params(lambda: nn.Conv2d(3, 4, 3, bias=False), device)
        return c(torch.randn(2, 3, 6, 6).to(device)).sum(), [c.weight]

    def norm(make: Callable[[], "nn.Module"], shape: Tuple[int, ...]) -> Callable[[str], Any]:
        def run(device: str) -> Any:
            m = params(make, device)
            x = torch.randn(*shape).to(device).requires_grad_()
            return (m(x) * torch.arange(x.numel()).reshape(shape).to(device)).sum(), \
                [x] + list(m.parameters())
        return run

    def embedding_bag(mode: str, weighted: bool) -> Callable[[str], Any]:
        def run(device: str) -> Any:
            torch.manual_seed(0)
            w = torch.randn(10, 3).to(device).requires_grad_()
            return (_embedding_bag(w, mode, weighted) * 3).sum(), [w]
        return run

    def sdpa(device: str) -> Any:  # only the query requires grad
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 4, 8).to(device) for _ in range(3))
        q.requires_grad_()
        return F.scaled_dot_product_attention(q, k, v).sum(), [q]

    def embedding(device: str) -> Any:
        torch.manual_seed(0)
        w = torch.randn(10, 3).to(device).requires_grad_()
        return F.embedding(torch.tensor([[1, 2], [4, 1]]).to(device), w, padding_idx=1).sum(), [w]

    return {
        "conv2d without bias": conv,
        "batch_norm without affine": norm(lambda: nn.BatchNorm2d(3, affine=False), (2, 3, 4, 4)),
        "batch_norm eval": norm(lambda: nn.BatchNorm2d(3).eval(), (2, 3, 4, 4)),
        "batch_norm without running stats": norm(
            lambda: nn.BatchNorm2d(3, track_running_stats=False), (2, 3, 4, 4)),
        "layer_norm without affine": norm(lambda: nn.LayerNorm(4, elementwise_affine=False),
                                          (2, 3, 4)),
        "layer_norm without bias": norm(lambda: nn.LayerNorm(4, bias=False), (2, 3, 4)),
        "group_norm without affine": norm(lambda: nn.GroupNorm(1, 3, affine=False), (2, 3, 4)),
        "instance_norm": norm(lambda: nn.InstanceNorm2d(3), (2, 3, 4, 4)),
        "embedding_bag sum": embedding_bag("sum", False),
        "embedding_bag sum weighted": embedding_bag("sum", True),
        "embedding_bag mean": embedding_bag("mean", False),
        "embedding_bag max": embedding_bag("max", False),
        "embedding with padding_idx": embedding,
        "scaled_dot_product_attention, query only": sdpa,
    }


@pytest.mark.parametrize("name", sorted(_module_cases()))
def test_backward_with_masked_outputs_and_absent_inputs_equals_the_cpu(name: str) -> None:
    """Forward and backward (twice: checking call, then queued) give the CPU's loss and
    gradients bit for bit."""
    fn = _module_cases()[name]
    loss, leaves = fn("cpu")
    expected = [loss.detach()] + list(torch.autograd.grad(loss, leaves))
    sim.set_latency(launch_us=200)
    for _ in range(2):
        loss, leaves = fn("sim:0")
        got = [loss.detach()] + list(torch.autograd.grad(loss, leaves))
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a.cpu(), b), f"{name}: result {i} differs"
    assert sim.races() == []


def test_queued_out_kernels_that_return_references_keep_their_arguments_alive() -> None:
    """svd's backward queues _linalg_svd.U, an out= kernel returning a tuple of Tensor&, whose
    boxed wrapper drops its arguments before pushing those references: the queued kernel keeps
    the CPU aliases alive (else freed TensorImpls: heap corruption, an abort, on torch 2.11)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        a = torch.randn(5, 3, generator=g)
        x = a.to("sim:0").requires_grad_()
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        (u.sum() + s.sum() + vh.sum()).backward()
        ar = a.clone().requires_grad_()
        u, s, vh = torch.linalg.svd(ar, full_matrices=False)
        (u.sum() + s.sum() + vh.sum()).backward()
        assert torch.equal(x.grad.cpu(), ar.grad)
    assert sim.races() == []


def test_resnet18_trains_on_the_asynchronous_sim_as_on_the_synchronous_one() -> None:
    """torchvision's resnet18 (no weights), two SGD steps with momentum in a pipeline: the same
    losses, weights and batch-norm statistics, bit for bit, as the synchronous sim."""
    from _resnet import resnet18

    _trains_as_synchronously(lambda: resnet18(num_classes=10), batch=(2, 3, 32, 32), classes=10,
                             steps=2, launch_us=50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("pin", [True, False])
def test_backward_through_a_non_blocking_copy_to_the_host(dtype: "torch.dtype", pin: bool) -> None:
    """The queued copy writes the host tensor through an alias of its own, so the tensor autograd
    made it the output of (ToCopyBackward0) keeps its history: gradients are the CPU's, not 0."""
    sim.set_latency(launch_us=2000)
    x = (torch.arange(6.0).reshape(2, 3) + 1).to(dtype).to("sim:0").requires_grad_()
    y = x.to("cpu", non_blocking=True) if pin else \
        torch.empty(2, 3, dtype=dtype).copy_(x, non_blocking=True)
    v0, grad_fn = y._version, type(y.grad_fn).__name__
    sim.synchronize()
    assert (y._version, type(y.grad_fn).__name__) == (v0, grad_fn)  # untouched by the kernel
    w = torch.arange(6.0).reshape(2, 3).to(dtype)
    (y * w).real.sum().backward() if dtype.is_complex else (y * w).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.arange(6.0).reshape(2, 3).to(dtype))


# ---- kernels that cannot be queued, kernel errors -------------------------------------------------
def test_ops_whose_output_size_depends_on_the_data_wait_for_the_stream() -> None:
    x = torch.arange(8.0, device="sim:0")
    slow("aten::remainder.Scalar_out")
    slow("aten::remainder.Tensor_out")
    mask = (x.remainder(2) == 0)
    assert torch.equal(torch.nonzero(mask).cpu().flatten(), torch.tensor([0, 2, 4, 6]))
    assert torch.equal(torch.masked_select(x, mask).cpu(), torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert torch.equal(torch.unique(x.remainder(3)).cpu(), torch.tensor([0.0, 1.0, 2.0]))


def test_a_kernel_error_is_reported_at_the_next_synchronizing_call() -> None:
    x = ones()
    idx = torch.tensor([0, N + 5], device="sim:0")
    x.index_select(0, torch.tensor([0, 1], device="sim:0"))  # checks the plan (runs at once)
    y = x.index_select(0, idx)          # queued: the index is checked when the kernel runs
    with pytest.raises(RuntimeError, match=r"aten::index_select.*sim:0 stream 0.*out of range"):
        torch.accelerator.synchronize()
    torch.accelerator.synchronize()      # reported once
    z = x.index_select(0, torch.tensor([1], device="sim:0"))
    with pytest.raises(RuntimeError, match="index_select"):
        x.index_select(0, idx)
        z.cpu()                           # a blocking copy reports it too
    del y


def test_an_error_a_host_check_raises_is_raised_by_the_call() -> None:
    """Dtype and shape checks raise at the call that made them, as on CUDA, on the first call of
    a plan and on later ones; nothing is left pending for the next synchronizing call."""
    b = torch.ones(4, dtype=torch.bool, device="sim:0")
    x, m = ones(), torch.ones(3, 5, device="sim:0")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Subtraction.*bool"):
            b - b
        with pytest.raises(RuntimeError, match="size"):
            x + torch.ones(3, device="sim:0")
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            m @ m
        with pytest.raises(RuntimeError, match="scalar type"):
            torch.nn.functional.layer_norm(m, (5,), weight=torch.ones(5, dtype=torch.float64,
                                                                       device="sim:0"))
    torch.accelerator.synchronize()  # nothing pending


def test_switching_modes_and_bad_latencies() -> None:
    slow("aten::mul.out", 50)
    y = ones() * 2
    sim.set_asynchronous(False)           # waits for every queue first
    assert _C._sim_running_executors() == 0
    assert torch.equal(y.cpu(), torch.full((N,), 2.0))
    sim.set_asynchronous(True)
    with pytest.raises(ValueError, match="launch_us"):
        sim.set_latency(launch_us=-1.0)
    with pytest.raises(ValueError, match="op="):
        sim.set_latency(us=5.0)
    sim.set_latency(launch_us=3.0, bandwidth_gbps=10.0)
    assert sim.latency() == (3.0, 10.0)


# ---- the streams' threads at exit and after fork() -----------------------------------------------
CHILD_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch_pipeline.sim as sim
    from torch_pipeline import _C
    sim.enable(2, asynchronous=True)
    sim.set_latency(op="aten::mul.out", us=20000)
    x = torch.ones(8, device="sim:0")
    x * 1                          # the first call of a plan runs at once: later ones queue
    s = torch.Stream(device="sim:0")
    with s:
        y = x * 2
    z = x * 3
    e = torch.Event()
    e.record()
    assert _C._sim_running_executors() >= 2, _C._sim_running_executors()
    torch.accelerator.synchronize()
    w = x * 4                      # pending at fork: the child drops it
    pid = os.fork()
    if pid == 0:
        ok = (_C._sim_running_executors() == 0 and e.query()
              and torch.equal((x * 5).cpu(), torch.full((8,), 5.0))
              and torch.equal(y.cpu(), torch.full((8,), 2.0)))
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert torch.equal(w.cpu(), torch.full((8,), 4.0))
    with s:
        y = x * 6                  # still queued when the interpreter exits
    print("done", flush=True)
""")


def test_stream_threads_stop_at_exit_and_are_dropped_by_a_forked_child() -> None:
    env = dict(os.environ)
    env.pop("TORCH_PIPELINE_SIM_TEST_CHILD", None)
    proc = subprocess.run([sys.executable, "-c", CHILD_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "done"
    assert "Error" not in proc.stderr and "terminate" not in proc.stderr, proc.stderr


def test_exit_step_drains_and_joins_the_threads() -> None:
    with torch.Stream(device="sim:0"):
        y = ones() * 2
    assert _C._sim_running_executors() >= 1
    sim._at_exit()
    assert _C._sim_running_executors() == 0
    assert not sim.is_asynchronous()
    torch.accelerator.synchronize()
    assert torch.equal(y.cpu(), torch.full((N,), 2.0))


install_proxies(globals(), __file__)
