"""The sim device's asynchronous mode and latency model (docs/design.md §5) on the sim device.

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
from typing import Iterator, List, Tuple

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
    with untracked():
        stale = program()
        assert stale != 8.0 * N, "the CPU read saw the copy's result without a wait"
        torch.accelerator.synchronize()
        assert any(r.later_op.endswith("(host)") for r in sim.races()), sim.races()


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


def test_a_tracked_training_step_equals_the_synchronous_run() -> None:
    """Forward, backward (the autograd engine's device thread queues the backward kernels) and SGD
    with momentum in a pipeline, every kernel 300 us: the same losses and weights, bit for bit."""
    import torch.nn as nn

    def train() -> Tuple[List[float], List["torch.Tensor"]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64),
                              nn.Linear(64, 10)).to("sim:0")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        p = tp.Pipeline()
        losses = []
        for _ in range(3):
            x = torch.randn(16, 32).to("sim:0")
            y = torch.randint(0, 10, (16,)).to("sim:0")
            with tp.pipeline(p):
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses, [w.detach().cpu() for w in model.parameters()]

    ref_losses, ref_weights = synchronous(train)
    sim.set_latency(launch_us=300)
    losses, weights = train()
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(ref_weights, weights))
    assert sim.races() == []


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


def test_queued_ops_return_the_outputs_not_asked_for_as_undefined_tensors() -> None:
    """convolution_backward and native_layer_norm_backward skip the gradients their output_mask
    does not ask for: queued, those are undefined Tensors (as on the CPU), not None, which
    autograd rejects ("Expected Tensor but got None"), e.g. the input gradient of a first conv."""
    def grads() -> List["torch.Tensor"]:
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 8, 3).to("sim:0")
        norm = torch.nn.LayerNorm(8, elementwise_affine=False)
        x = torch.randn(2, 3, 6, 6).to("sim:0")      # needs no gradient
        norm(conv(x).permute(0, 2, 3, 1)).square().sum().backward()
        return [conv.weight.grad, conv.bias.grad]

    for got, want in zip(grads(), synchronous(grads)):
        assert torch.equal(got.cpu(), want.cpu())


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
    y = x.index_select(0, idx)          # queued: the index is checked when the kernel runs
    with pytest.raises(RuntimeError, match=r"aten::index_select.*sim:0 stream 0.*out of range"):
        torch.accelerator.synchronize()
    torch.accelerator.synchronize()      # reported once
    z = x.index_select(0, torch.tensor([1], device="sim:0"))
    with pytest.raises(RuntimeError, match="index_select"):
        x.index_select(0, idx)
        z.cpu()                           # a blocking copy reports it too
    del y


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
