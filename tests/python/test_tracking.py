"""Automatic synchronization (docs/design.md, "Automatic synchronization") on the sim device in
strict mode.

Each rule (docs/design.md, "The rules") gets a minimal program that runs clean (strict mode would
raise sim.RaceError on a race) with tracking on, and whose twin with tracking switched off (the
test-only switch ``_C._set_tracking_enabled(False)``) reports the race: the tests fail when the
behaviour is removed. Then: a training step split across pipelines, cross-device copies,
non_blocking copies to the host, memory freed after a cross-stream use, tp.track for kernels the
dispatcher never sees, tensors passed to submit, and a few hundred random programs whose values
equal the same program on the default pipeline, with zero races, while the same programs untracked
do race.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import contextlib
import gc
import random
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

from _sim_child import (IN_CHILD, fake_process_group, install_proxies, tracked_sim_fixtures,
                        untracked)

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from _programs import check_programs, make_pipelines, make_program, run_program
    from torch_pipeline import _C

N = 4096  # elements of the test tensors


# ---- fixtures and helpers (child process) --------------------------------------------------------
_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def stats() -> Dict[str, int]:
    return dict(_C._tracking_stats())


def ones(value: float = 1.0, device: str = "sim:0") -> "torch.Tensor":
    return torch.full((N,), value, device=device)


@pytest.fixture
def exact_waits() -> Iterator[None]:
    """Counting waits: allocator safety by record_stream, whose polls-free bookkeeping never tells
    the tracker that work completed (holding does, and a completed producer needs no wait)."""
    _C._set_allocator_safety("record_stream")
    yield
    _C._set_allocator_safety("keep_alive")


def race_ops(races: List[object]) -> List[Tuple[str, str]]:
    return [(r.earlier_op, r.later_op) for r in races]  # type: ignore[attr-defined]


# ---- liveness: no work without pipelines ---------------------------------------------------------
def test_tracking_is_live_only_while_a_pipeline_is_alive() -> None:
    gc.collect()
    assert not stats()["live"]
    x = ones()
    before = stats()["ops"]
    for _ in range(50):
        x = x + 1
    assert stats()["ops"] == before, "ops were observed while no pipeline was alive"
    p = tp.Pipeline()
    assert stats()["live"]
    y = x * 2
    assert stats()["ops"] > before
    del p
    gc.collect()
    assert not stats()["live"]
    assert stats()["storages"] == 0, "state was kept after tracking went idle"
    assert torch.equal(y.cpu(), torch.full((N,), 102.0))


# ---- the rules, each with its untracked twin ------------------------------------------------------
def read_after_write(p: "tp.Pipeline") -> "torch.Tensor":
    x = ones()
    with tp.pipeline(p):
        y = x * 3      # written on p's stream
    return y + 1       # read on the default stream


def test_read_after_write_waits_for_the_writer(exact_waits: None) -> None:
    p = tp.Pipeline()
    before = stats()["waits"]
    z = read_after_write(p)
    assert stats()["waits"] > before
    assert torch.equal(z.cpu(), torch.full((N,), 4.0))
    assert sim.races() == []
    with untracked():
        read_after_write(p)
        assert any(later == "aten::add.out" for _, later in race_ops(sim.races())), sim.races()


def write_after_read(p1: "tp.Pipeline", p2: "tp.Pipeline") -> Tuple["torch.Tensor", ...]:
    x = ones()
    torch.accelerator.synchronize()  # (x's fill is complete: only the reads below matter)
    with tp.pipeline(p1):
        a = x * 2      # reads x on p1's stream
    with tp.pipeline(p2):
        b = x * 3      # reads x on p2's stream
    x.fill_(7)         # write on the default stream: must wait for both readers
    return a, b, x


def test_write_after_read_waits_for_every_reader() -> None:
    p1, p2 = tp.Pipeline(), tp.Pipeline()
    a, b, x = write_after_read(p1, p2)
    assert torch.equal(a.cpu(), torch.full((N,), 2.0))
    assert torch.equal(b.cpu(), torch.full((N,), 3.0))
    assert sim.races() == []
    with untracked():
        write_after_read(p1, p2)
        readers = {earlier for earlier, later in race_ops(sim.races()) if later == "aten::fill_.Scalar"}
        assert readers == {"aten::mul.out"}, sim.races()
        assert len([r for r in sim.races() if r.later_op == "aten::fill_.Scalar"]) == 2


def home_uses_then_another_stream(p: "tp.Pipeline") -> Tuple["torch.Tensor", ...]:
    with tp.pipeline(p):
        x = ones() * 2     # made on p's stream: its uses there are only noted (Note [Home-stream uses])
        y = ones() * 2
    ones()                 # p's run ends: its event is recorded at x's and y's definitions
    with tp.pipeline(p):
        a = x * 3          # home uses after that event: a read of x ...
        y.mul_(5)          # ... and a write of y
    x.fill_(7)             # on the default stream: waits for the read, not only x's definition
    z = y + 1              # waits for the write, not only y's definition
    return a, x, z


def test_home_stream_uses_are_waited_for_once_another_stream_uses_the_storage() -> None:
    p = tp.Pipeline()
    a, x, z = home_uses_then_another_stream(p)
    assert torch.equal(a.cpu(), torch.full((N,), 6.0))
    assert torch.equal(x.cpu(), torch.full((N,), 7.0))
    assert torch.equal(z.cpu(), torch.full((N,), 11.0))
    assert sim.races() == []
    with untracked():
        home_uses_then_another_stream(p)
        later = {later for _, later in race_ops(sim.races())}
        assert {"aten::fill_.Scalar", "aten::add.Tensor"} & later, sim.races()


def unknown_origin_then_another_stream() -> Tuple["torch.Tensor", ...]:
    gc.collect()
    assert not stats()["live"]
    x = ones(2.0)          # made while tracking is idle: allocation stream and writer unknown
    y = ones(2.0)
    p = tp.Pipeline()
    with tp.pipeline(p):
        a = x * 3          # x's first use: adopted by p's stream, the read only noted there
        y.mul_(5)          # y's first use: a write, only noted there
    x.fill_(7)             # on the default stream: waits for p's read of x
    z = y + 1              # waits for p's write of y
    del p
    return a, x, z


def test_uses_of_a_storage_of_unknown_origin_are_waited_for_once_another_stream_uses_it() -> None:
    """Note [Storages of unknown origin]: the first stream to use a storage made while tracking
    was idle adopts it (recorded with the allocator there) and notes its uses like those of its own
    outputs; another stream's use then waits for them."""
    a, x, z = unknown_origin_then_another_stream()
    assert torch.equal(a.cpu(), torch.full((N,), 6.0))
    assert torch.equal(x.cpu(), torch.full((N,), 7.0))
    assert torch.equal(z.cpu(), torch.full((N,), 11.0))
    assert sim.races() == []
    with untracked():
        unknown_origin_then_another_stream()
        raced = set(race_ops(sim.races()))
        # (sim names in-place ops by the out= kernels they run: mul_ as aten::mul.out)
        assert {("aten::mul.out", "aten::fill_.Scalar"),
                ("aten::mul.out", "aten::add.out")} <= raced, sim.races()


_CACHED_OPS: "Optional[torch.library.Library]" = None
_CACHE: List["torch.Tensor"] = []


def cached_double(x: "torch.Tensor") -> "torch.Tensor":
    """An op that returns a tensor it holds (a cache), filled with 2 * x: its output is no input of
    the op, yet its storage is not new (the schema does not say it aliases anything)."""
    global _CACHED_OPS
    if _CACHED_OPS is None:
        _CACHED_OPS = torch.library.Library("tp_test_cache", "DEF")
        _CACHED_OPS.define("cached_double(Tensor x) -> Tensor")

        def kernel(t: "torch.Tensor") -> "torch.Tensor":
            torch.mul(t, 2, out=_CACHE[0])
            return _CACHE[0]

        _CACHED_OPS.impl("cached_double", kernel, "PrivateUse1")
    return torch.ops.tp_test_cache.cached_double(x)


def known_storage_returned_as_an_output(p: "tp.Pipeline") -> "torch.Tensor":
    _CACHE[:] = [torch.zeros(N, device="sim:0")]   # made on the default stream
    with tp.pipeline(p):
        _CACHE[0].add_(1)      # used on p's stream too: the storage has an entry
        out = cached_double(ones(5.0))   # p's stream writes it and returns it as an output
    return out * 3             # on the default stream: waits for that write


def test_an_output_whose_storage_the_tracker_knows_is_redefined_by_the_op() -> None:
    """An op's output that is none of its inputs counts as made by the op, on its stream; when its
    storage is one the tracker has seen (a tensor an op keeps and returns), that redefines the
    storage's entry (the weak-count shortcut for new storages must not take it for a new one)."""
    p = tp.Pipeline()
    z = known_storage_returned_as_an_output(p)
    assert torch.equal(z.cpu(), torch.full((N,), 30.0))
    assert sim.races() == []
    with untracked():
        known_storage_returned_as_an_output(p)
        # (sim names out-of-place ops by the out= kernels they run: `out * 3` as aten::mul.out)
        assert ("aten::mul.out", "aten::mul.out") in race_ops(sim.races()), sim.races()


def test_a_storage_of_unknown_origin_used_on_one_stream_costs_no_entry() -> None:
    """An adopted storage is recorded with the allocator once, on the stream that adopted it, and
    stays young (no entry in the storage table) while only that stream uses it."""
    gc.collect()
    assert not stats()["live"]
    xs = [ones() for _ in range(8)]
    p = tp.Pipeline()
    entries = _C._tracker_parts()["storages"]["entries"]
    before = stats()
    with tp.pipeline(p):
        for x in xs:
            x.mul_(2)
            x.add_(1)
            x.sum()
    after = stats()
    assert after["record_streams"] - before["record_streams"] == len(xs)
    assert _C._tracker_parts()["storages"]["entries"] == entries
    assert [x[0].item() for x in xs] == [3.0] * len(xs)


def write_after_write(p: "tp.Pipeline") -> "torch.Tensor":
    x = ones()
    with tp.pipeline(p):
        x.mul_(5)      # write on p
    x.add_(1)          # write on the default stream
    return x


def test_write_after_write_waits_for_the_writer() -> None:
    p = tp.Pipeline()
    assert torch.equal(write_after_write(p).cpu(), torch.full((N,), 6.0))
    with untracked():
        write_after_write(p)
        # (sim names in-place ops by the out= kernels they run: mul_ as aten::mul.out)
        assert ("aten::mul.out", "aten::add.out") in race_ops(sim.races()), sim.races()


def test_no_wait_between_ops_of_one_stream(exact_waits: None) -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        x = ones()
        before = stats()["waits"]
        for _ in range(20):
            x = torch.sin(x) * 2
            x.add_(1)
    assert stats()["waits"] == before


def test_a_stream_waits_once_per_producer_position(exact_waits: None) -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        a = ones(1.0)
        b = ones(2.0)      # p's latest write: waiting for it covers a too
    before = stats()["waits"]
    c = b + a              # one wait (for b's position; a's is implied)
    assert stats()["waits"] == before + 1
    d = a * b              # already ordered: no wait
    e = c + d
    assert stats()["waits"] == before + 1
    assert torch.equal(e.cpu(), torch.full((N,), 5.0))


def test_transitive_orderings_suppress_waits(exact_waits: None) -> None:
    p1, p2 = tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(p1):
        a = ones(1.0)
    with tp.pipeline(p2):
        b = a + 1          # p2 waits for p1
    before = stats()["waits"]
    c = b + a              # waiting for p2 implies p1: one wait
    assert stats()["waits"] == before + 1
    assert torch.equal(c.cpu(), torch.full((N,), 3.0))


def test_an_output_first_used_long_after_it_was_made_is_waited_for() -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        first = ones(2.0)
        temps = [ones(float(i)) for i in range(200)]  # many outputs made after it on p
    del temps
    assert torch.equal((first + 1).cpu(), torch.full((N,), 3.0))  # read on the default stream


# ---- writes a schema hides (Note [Writes a schema hides]) -----------------------------------------
def _norm_module(kind: str) -> "torch.nn.Module":
    # instance norm tracking running statistics updates them in place too (aten::instance_norm)
    if kind == "batch_norm":
        return torch.nn.BatchNorm1d(4)
    return torch.nn.InstanceNorm1d(4, track_running_stats=True)


def running_stats_then_read(pa: Optional["tp.Pipeline"], pb: Optional["tp.Pipeline"], kind: str,
                            device: str = "sim:0") -> Tuple["torch.Tensor", "torch.Tensor"]:
    norm = _norm_module(kind).to(device)
    x = torch.arange(96.0, device=device).reshape(4, 4, 6) / 7
    if device != "cpu":
        torch.accelerator.synchronize()  # (only what follows matters)
    with tp.pipeline(pa):
        for _ in range(3):
            norm(x)    # training: running_mean and running_var updated in place on pa's stream
    with tp.pipeline(pb):
        return norm.running_mean * 1, norm.running_var * 1  # read on pb's stream


@pytest.mark.parametrize("kind", ["batch_norm", "instance_norm"])
def test_a_read_of_running_statistics_waits_for_their_update(kind: str) -> None:
    # The schemas of aten::batch_norm and aten::instance_norm do not mark running_mean and
    # running_var written: read as reads, the read on pb would not wait for pa's updates.
    pa, pb = tp.Pipeline(), tp.Pipeline()
    mean, var = running_stats_then_read(pa, pb, kind)
    want_mean, want_var = running_stats_then_read(None, None, kind, device="cpu")
    assert torch.allclose(mean.cpu(), want_mean) and torch.allclose(var.cpu(), want_var)
    assert sim.races() == []
    with untracked():
        running_stats_then_read(pa, pb, kind)
        # (the sim reports the update by the kernel that wrote it, copy_ in its batch norm)
        assert any(later == "aten::mul.out" for _, later in race_ops(sim.races())), sim.races()


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_writes_its_running_statistics_only_when_training(exact_waits: None,
                                                                     training: bool) -> None:
    # In eval mode two pipelines may run the same batch norm side by side: no wait between them.
    pa, pb = tp.Pipeline(), tp.Pipeline()
    mean, var = torch.zeros(4, device="sim:0"), torch.ones(4, device="sim:0")
    x = torch.arange(64.0, device="sim:0").reshape(16, 4)

    def norm() -> "torch.Tensor":
        return torch.nn.functional.batch_norm(x, mean, var, training=training)

    with tp.pipeline(pb):
        norm()         # pb is ordered after what made x and the statistics (and, training, writes)
    with tp.pipeline(pa):
        norm()         # pa too (and, training, writes the running statistics after pb)
    before = stats()["waits"]
    with tp.pipeline(pb):
        norm()
    assert stats()["waits"] == before + (1 if training else 0)
    assert sim.races() == []


# ---- going live and idle --------------------------------------------------------------------------
def test_work_before_a_pipeline_exists_is_ordered_before_it() -> None:
    gc.collect()
    assert not stats()["live"]
    x = ones()
    x.mul_(3)              # untracked (no pipeline yet), on the default stream
    p = tp.Pipeline()
    with tp.pipeline(p):
        y = x + 1          # p's stream waits for the go-live baseline
    assert torch.equal(y.cpu(), torch.full((N,), 4.0))


def test_work_after_the_last_pipeline_dies_is_ordered_after_it() -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        y = ones() * 3
    del p
    gc.collect()
    assert not stats()["live"]
    z = y + 1              # untracked, on the default stream: the default stream waited at idle
    assert torch.equal(z.cpu(), torch.full((N,), 4.0))


FIRST_OPS: Dict[str, Callable[[], "torch.Tensor"]] = {
    "factory": lambda: ones(-5.0),
    "blocking copy to the device": lambda: torch.full((N,), -5.0).to("sim:0"),
    "torch.tensor on the device": lambda: torch.tensor([-5.0] * N, device="sim:0"),
}


def reuse_across_an_idle_stretch(first_op: Callable[[], "torch.Tensor"]) -> List[float]:
    seen = []
    for i in range(3):
        p = tp.Pipeline()
        with tp.pipeline(p):
            w = ones(float(i))     # allocated on p's stream
        del p                      # tracking goes idle
        z = w + 1                  # untracked, on the default stream
        del w                      # back to the pool of p's stream (nothing recorded: idle)
        q = tp.Pipeline()          # live again: p's slot, and with it p's stream
        with tp.pipeline(q):
            v = first_op()         # the stream's first op of the period: allocates w's block
        del q
        seen.append(z[0].item())
        del v
    return seen


@pytest.mark.parametrize("first_op", list(FIRST_OPS))
def test_memory_used_while_idle_is_not_reused_by_the_next_pipeline(first_op: str) -> None:
    """The go-live baseline orders a stream after the untracked work before it at the stream's
    first tracked use: that must come before an op whose output is new memory on that stream runs
    there (a factory, a blocking copy from the host: it allocates, maybe a block the untracked
    stretch still reads), not only after it."""
    gc.collect()
    assert not stats()["live"]
    assert reuse_across_an_idle_stretch(FIRST_OPS[first_op]) == [1.0, 2.0, 3.0]
    assert sim.races() == []
    with untracked():
        reuse_across_an_idle_stretch(FIRST_OPS[first_op])
        assert sim.races(), "the untracked twin did not race"


# ---- training step across pipelines ---------------------------------------------------------------
class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: "torch.Tensor", pa: "Optional[tp.Pipeline]",
                pb: "Optional[tp.Pipeline]") -> "torch.Tensor":
        with tp.pipeline(pa):
            ha = self.a(x).relu()
        with tp.pipeline(pb):
            hb = self.b(x).tanh()
        return self.head(ha * hb)


def train(pa: "Optional[tp.Pipeline]", pb: "Optional[tp.Pipeline]", steps: int = 3) -> List["torch.Tensor"]:
    torch.manual_seed(0)
    model = TwoBranches().to("sim:0")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g).to("sim:0")
        target = torch.randn(16, 4, generator=g).to("sim:0")
        loss = torch.nn.functional.mse_loss(model(x, pa, pb), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


def test_training_step_split_across_pipelines_matches_the_default_pipeline() -> None:
    reference = train(None, None)
    pa, pb = tp.Pipeline(), tp.Pipeline(tp.get_worker_thread(1))
    ops_before = stats()["ops"]
    got = train(pa, pb)
    assert stats()["ops"] > ops_before
    for r, g in zip(reference, got):
        assert torch.equal(r, g)
    assert sim.races() == []
    with untracked():
        train(pa, pb, steps=1)
        assert sim.races(), "the split training step did not race without tracking"


# ---- devices and the host ---------------------------------------------------------------------------
def cross_device(p0: "tp.Pipeline", p1: "tp.Pipeline") -> "torch.Tensor":
    with tp.pipeline(p0):
        a = ones(2.0, "sim:0") * 3
    with tp.pipeline(p1):
        b = a.to("sim:1")          # copy out of p0's work
        b.mul_(2)
    return b.to("sim:0") + a       # back, read on the default stream of sim:0


def test_cross_device_copies_are_ordered() -> None:
    p0, p1 = tp.Pipeline(), tp.Pipeline()
    out = cross_device(p0, p1)
    assert torch.equal(out.cpu(), torch.full((N,), 18.0))
    assert sim.races() == []
    with untracked():
        cross_device(p0, p1)
        assert sim.races()


def test_non_blocking_copy_to_the_host_is_waited_for_before_a_cpu_read() -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        y = ones(2.0) * 4
        host = y.to("cpu", non_blocking=True)
    assert host.is_pinned()
    before = stats()["host_waits"]
    total = host.sum().item()      # a CPU op: waits for the copy first
    assert stats()["host_waits"] == before + 1
    assert total == 8.0 * N
    assert sim.races() == []
    with untracked():
        with tp.pipeline(p):
            host2 = (ones(2.0) * 4).to("cpu", non_blocking=True)
        host2.sum()
        assert any(r.later_op.endswith("(host)") for r in sim.races()), sim.races()


def test_non_blocking_copy_into_existing_pinned_memory() -> None:
    p = tp.Pipeline()
    host = torch.empty(N, pin_memory=True)
    with tp.pipeline(p):
        host.copy_(ones(5.0), non_blocking=True)
    assert host[0].item() == 5.0
    host.fill_(1.0)                # CPU write after the copy: ordered
    with tp.pipeline(p):
        back = host.to("sim:0", non_blocking=True)   # reads host on p's stream
    host.fill_(2.0)                # CPU write while the copy may still read: waits
    assert torch.equal(back.cpu(), torch.full((N,), 1.0))
    assert sim.races() == []


_HOST_CHECK_FIRST = """
import torch
import torch_pipeline as tp
import torch_pipeline.sim as sim

sim.enable(num_devices=1)
x = torch.full((4096,), 3.0, device="sim:0")
early = x.to("cpu", non_blocking=True)   # no pipeline yet: the host check's callback comes first
sim.synchronize()
assert early.sum().item() == 3.0 * 4096
p = tp.Pipeline()                        # the tracker's callback is added after it
for _ in range(20):
    with tp.pipeline(p):
        host = (x * 2).to("cpu", non_blocking=True)
    assert host.sum().item() == 6.0 * 4096   # the tracker waits for the copy, then the read
print("RACES", len(sim.races()))
"""


def test_host_reads_are_checked_after_the_trackers_wait_whatever_the_callback_order() -> None:
    """The sim's host check added its callback before the tracker's (a non_blocking copy to the
    host before the first pipeline): the CPU reads the tracker orders after the copy are still no
    races (Note [The host check records at the end])."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    proc = subprocess.run([sys.executable, "-c", _HOST_CHECK_FIRST], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RACES 0" in proc.stdout, proc.stdout + proc.stderr


def free_after_cross_stream_use(p: "tp.Pipeline") -> None:
    x = ones()                 # allocated on the default stream
    with tp.pipeline(p):
        y = x * 2              # used on p's stream
    del x                      # freed while p's read may be pending
    z = ones(9.0)              # the same size: the allocator's first choice is x's block
    del y, z


@pytest.mark.parametrize("mode", ["keep_alive", "record_stream"])
def test_memory_freed_after_a_cross_stream_use_is_not_reused_early(mode: str) -> None:
    _C._set_allocator_safety(mode)
    try:
        p = tp.Pipeline()
        before = stats()
        free_after_cross_stream_use(p)
        after = stats()
        if mode == "keep_alive":
            assert after["keep_alives"] > before["keep_alives"] and after["record_streams"] == before["record_streams"]
        else:
            assert after["record_streams"] > before["record_streams"] and after["keep_alives"] == before["keep_alives"]
        assert sim.races() == []
        with untracked():
            free_after_cross_stream_use(p)
            assert sim.races(), "reuse of a block still read on another stream went unreported"
    finally:
        _C._set_allocator_safety("keep_alive")


@pytest.fixture
def holding() -> Iterator[None]:
    assert _C._allocator_safety() == "keep_alive"  # the default
    yield


def test_holding_is_the_default() -> None:
    assert _C._allocator_safety() == "keep_alive"
    with pytest.raises(ValueError, match="'keep_alive' or 'record_stream'"):
        _C._set_allocator_safety("sometimes")


def test_held_memory_returns_once_the_use_is_complete(holding: None) -> None:
    p = tp.Pipeline()
    torch.accelerator.synchronize(0)
    base = torch.accelerator.memory_allocated(0)
    x = ones()
    with tp.pipeline(p):
        y = x * 2              # x (made on the default stream) used on p's stream: held
    del x
    assert stats()["kept_alive"] >= 1
    assert torch.accelerator.memory_allocated(0) == base + 2 * N * 4   # x is still held
    tp.synchronize()           # the use is complete: x's memory goes back
    assert stats()["kept_alive"] == 0
    assert torch.accelerator.memory_allocated(0) == base + N * 4
    del y


def test_held_memory_returns_during_later_work(holding: None) -> None:
    p = tp.Pipeline()
    x = ones()
    with tp.pipeline(p):
        y = x * 2
    del x
    released = stats()["released"]
    z = y
    for _ in range(40):        # later ops poll the held storages (the use is complete on sim
        z = z + 1              # once the host asks)
    assert stats()["released"] > released and stats()["kept_alive"] == 0


# ---- tp.track -------------------------------------------------------------------------------------
def raw_program(p: "tp.Pipeline", declare: bool) -> None:
    x = ones()
    y = torch.empty(N, device="sim:0")
    with tp.pipeline(p):
        scope = tp.track(read=[x], write=y) if declare else contextlib.nullcontext()
        with scope:
            sim.raw_kernel("my_ext::kernel", read=[x], write=[y])
    y.sum()                    # read on the default stream after the raw write on p


def test_track_declares_accesses_the_dispatcher_never_sees() -> None:
    p = tp.Pipeline()
    raw_program(p, declare=True)
    assert sim.races() == []
    sim.set_strict(False)
    raw_program(p, declare=False)   # the same kernel undeclared: tracking cannot see it
    assert any("my_ext::kernel" in (r.earlier_op, r.later_op) for r in sim.races()), sim.races()


def test_track_rejects_non_tensors() -> None:
    with pytest.raises(TypeError, match="expects tensors"):
        tp.track(read=[1])
    with pytest.raises(TypeError, match="tensor or an iterable"):
        tp.track(write=3)


# ---- tensors passed to submit ----------------------------------------------------------------------
def submitted_then_overwritten(p: "tp.Pipeline") -> float:
    x = ones(1.0)
    started = threading.Event()

    def task(t: "torch.Tensor") -> float:
        started.set()
        time.sleep(0.2)
        return t.sum().item()

    fut = p.submit(task, x)
    started.wait(5)
    x.fill_(100.0)             # the submitter's later in-place write
    return fut.wait()


def test_a_later_write_by_the_submitter_waits_for_the_task() -> None:
    p = tp.Pipeline(tp.get_worker_thread(1))
    before = stats()["pin_waits"]
    assert submitted_then_overwritten(p) == float(N)
    assert stats()["pin_waits"] == before + 1
    assert sim.races() == []
    with untracked():
        assert submitted_then_overwritten(p) == 100.0 * N   # without the hold, the task sees it


def test_the_task_may_write_its_own_arguments() -> None:
    p = tp.Pipeline(tp.get_worker_thread(1))
    x = ones(1.0)
    fut = p.submit(lambda t: t.mul_(3), x)
    fut.wait()
    assert torch.equal(x.cpu(), torch.full((N,), 3.0))


# ---- communication streams: tp.collective() ---------------------------------------------------------
_FAKE_COLLECTIVES: "Optional[torch.library.Library]" = None


def fake_all_reduce_(t: "torch.Tensor") -> None:
    """A stand-in for a collective on sim tensors (Gloo and NCCL take none): a dispatcher op that
    writes its argument in place, as c10d::allreduce_ does (here: a world of 2 equal ranks)."""
    global _FAKE_COLLECTIVES
    if _FAKE_COLLECTIVES is None:
        _FAKE_COLLECTIVES = torch.library.Library("tp_test", "DEF")
        _FAKE_COLLECTIVES.define("fake_all_reduce_(Tensor(a!) t) -> ()")
        def kernel(x: "torch.Tensor") -> None:
            x.mul_(2)

        _FAKE_COLLECTIVES.impl("fake_all_reduce_", kernel, "PrivateUse1")
    torch.ops.tp_test.fake_all_reduce_(t)


def test_collective_makes_the_comm_stream_of_the_worker_thread_current() -> None:
    p = tp.Pipeline(tp.get_worker_thread(1))
    before = torch.accelerator.current_stream(0)
    comm0 = tp.comm_stream("sim:0", worker_thread=0)
    comm1 = tp.comm_stream("sim:0", worker_thread=tp.get_worker_thread(1))
    assert comm0 != comm1 and comm1 != p.stream("sim:0") and comm0 != before
    with tp.collective():
        assert torch.accelerator.current_stream(0) == comm0   # main thread, default pipeline
    assert torch.accelerator.current_stream(0) == before
    with tp.pipeline(p), tp.collective():
        assert torch.accelerator.current_stream(0) == comm1   # p's worker thread's
        assert tp.comm_stream() == comm1
    q = tp.Pipeline(tp.get_worker_thread(1))                  # shared by the worker's pipelines
    with tp.pipeline(q), tp.collective():
        assert torch.accelerator.current_stream(0) == comm1

    def in_task() -> bool:
        with tp.collective():
            return torch.accelerator.current_stream(0) == comm1 == tp.comm_stream()

    assert p.submit(in_task).wait()
    with pytest.raises(ValueError, match="out of range"):
        tp.comm_stream("sim:0", worker_thread=99)


def collective_program(p: "tp.Pipeline") -> "torch.Tensor":
    with tp.pipeline(p):
        x = ones(3.0)                  # the producer, on p's stream
    with tp.collective():
        fake_all_reduce_(x)            # on the comm stream: waits for the producer
    return x + 1                       # the consumer, on the default stream: waits for it


def test_the_tracker_orders_a_collective_between_its_producer_and_its_consumer() -> None:
    p = tp.Pipeline(tp.get_worker_thread(1))
    y = collective_program(p)
    assert torch.equal(y.cpu(), torch.full((N,), 7.0))
    assert sim.races() == []
    with untracked():
        collective_program(p)
        later = {r.later_op for r in sim.races()}
        assert any("mul" in op for op in later), sim.races()   # the collective's input
        assert any("add" in op for op in later), sim.races()   # its consumer


def test_collective_orders_itself_while_tracking_is_idle() -> None:
    """With no non-default pipeline alive nothing is tracked: collective() itself makes the comm
    stream wait for the stream it replaces, and that stream wait for it on exit."""
    gc.collect()
    assert not stats()["live"]
    x = ones(3.0)                      # default stream
    with tp.collective():
        assert torch.accelerator.current_stream(0) == tp.comm_stream("sim:0", worker_thread=0)
        fake_all_reduce_(x)            # comm stream (strict: raises without the entry wait)
    y = x + 1                          # default stream (raises without the exit wait)
    assert torch.equal(y.cpu(), torch.full((N,), 7.0))
    assert sim.races() == []


def test_collectives_write_their_tensors(exact_waits: None) -> None:
    """c10d schemas carry no alias annotations: the tracker knows that all_reduce writes its
    tensor, so the collective waits for an earlier reader on another stream (write after read)."""
    import torch.distributed as dist

    fake_process_group()
    reader = tp.Pipeline()
    x = ones(3.0)
    with tp.collective():
        x + 0                           # (the comm stream's first use and x's writer: waited)
    with tp.pipeline(reader):
        y = x * 2                       # reads x on the reader's stream
    before = stats()["waits"]
    with tp.collective():
        dist.all_reduce(x)              # writes x on the comm stream: waits for the reader
    assert stats()["waits"] == before + 1
    assert torch.equal(y.cpu(), torch.full((N,), 6.0))


def test_an_async_collective_is_ready_where_it_was_waited_for() -> None:
    """async_op=True: the outputs count as written where work.wait() ran (torch_pipeline hooks
    Work.wait), so later readers wait for that point, not for the issuing stream alone."""
    import torch.distributed as dist

    fake_process_group()
    p, q = tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(p):
        x = ones(3.0)
    with tp.collective():
        work = dist.all_reduce(x, async_op=True)
    before = stats()["launches"]
    with tp.pipeline(q):
        work.wait()                     # q's stream waits for the collective
    assert stats()["launches"] == before + 1   # x is now written at q's position
    assert torch.equal((x + 1).cpu(), torch.full((N,), 4.0))
    assert sim.races() == []


def test_async_collectives_on_tensor_arguments() -> None:
    """all_gather_into_tensor and reduce_scatter_tensor take their tensors as Tensor arguments, not
    lists (c10d::_allgather_base_, _reduce_scatter_base_): the Work they return is noted at the
    op's end, after the boxed arguments are gone (reading them there crashed the process)."""
    import torch.distributed as dist

    fake_process_group()
    p, q = tp.Pipeline(), tp.Pipeline()
    for _ in range(20):
        with tp.pipeline(p):
            x = ones(3.0)
            out = torch.empty(2 * N, device="sim:0")
        with tp.collective():
            gathered = dist.all_gather_into_tensor(out, x, async_op=True)
            scattered = dist.reduce_scatter_tensor(x, out, async_op=True)
        before = stats()["launches"]
        with tp.pipeline(q):
            gathered.wait()             # out, then x, count as written at q's position
            scattered.wait()
        assert stats()["launches"] == before + 2
        (out + 1).sum()                 # (the fake backend writes nothing: values stay)
    assert sim.races() == []


# ---- random programs (tests/python/_programs.py) -------------------------------------------------
DEVICES = ("sim:0", "sim:1")


def test_random_programs_match_the_default_pipeline_without_races() -> None:
    # The reference runs on the default pipeline while tracking is live (a pipeline is alive): its
    # non_blocking copies to the host are then synchronized too, as they are in the tracked run.
    keep_live = tp.Pipeline()
    assert check_programs(300, DEVICES) == 300   # strict: a race raises
    assert sim.races() == []                      # (host-side races are recorded, not raised)
    tp.synchronize()
    assert stats()["kept_alive"] == 0                   # memory held for uses went back
    del keep_live


def test_random_programs_with_record_stream() -> None:
    """The same kind of programs with allocator safety by record_stream (instead of holding)."""
    _C._set_allocator_safety("record_stream")
    try:
        keep_live = tp.Pipeline()
        assert check_programs(100, DEVICES, seed=99) == 100
        assert sim.races() == []
        del keep_live
    finally:
        _C._set_allocator_safety("keep_alive")


def test_random_programs_race_without_tracking() -> None:
    """The same programs untracked report races: the test above can fail."""
    rng = random.Random(1234)
    racy = 0
    with untracked():
        for n in range(100):
            program = make_program(rng)
            run_program(program, [None] * 4, n, DEVICES)
            sim.clear_races()
            run_program(program, make_pipelines(rng), n, DEVICES)
            racy += bool(sim.races())
            sim.clear_races()
    assert racy >= 50, f"only {racy} of 100 untracked programs raced"


install_proxies(globals(), __file__)
