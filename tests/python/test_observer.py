"""How ops are observed: the dispatcher path (the default) and the threads it observes.

The default observer is a dispatcher fallback on a thread-local key (docs/design.md, "What
observing costs"): a thread's ops are observed while it carries the key. These tests check who
carries it (the thread that makes tracking go live, Python threads that ran before, threads
started later, threads of an earlier live period), that a thread nobody gave it is noticed and
warned about once and then observed, that the ops an observed op calls never reach the
fallback, that wrapper subclasses and DTensor are seen through on strict sim, that profilers
still see every op and range, and that the RecordFunction path stays selectable.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import Any, Dict, List

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=1)

N = 1 << 12

# The tests of the dispatcher path's keys (CI runs this file on the RecordFunction path too).
dispatcher_only = pytest.mark.skipif(
    os.environ.get("TORCH_PIPELINE_OBSERVER", "dispatcher") != "dispatcher",
    reason="checks the dispatcher path's keys; this run observes with RecordFunction")


def idle() -> None:
    gc.collect()
    assert not _C._tracking_live(), "a pipeline of an earlier test is still alive"


@dispatcher_only
def test_the_default_observer_is_the_dispatcher_path() -> None:
    idle()
    p = tp.Pipeline()
    assert tp.tracking_stats()["observer"] == "dispatcher"
    assert _C._observer_key_state() == (True, False)  # the thread that made it live
    del p
    idle()
    torch.ones(2).add_(1)  # the first op after going idle lets go of the key
    assert _C._observer_key_state() == (False, False)


def test_callees_of_an_observed_op_are_not_observed() -> None:
    """conv2d calls convolution, _convolution and more: one observed op."""
    w = torch.randn(8, 3, 3, 3).to("sim:0")
    x = torch.randn(2, 3, 16, 16).to("sim:0")
    p = tp.Pipeline()
    before = tp.tracking_stats()["ops"]
    with tp.pipeline(p):
        y = torch.nn.functional.conv2d(x, w)
    assert tp.tracking_stats()["ops"] - before == 1
    assert torch.equal(y.cpu(), torch.nn.functional.conv2d(x.cpu(), w.cpu()))
    assert sim.races() == []


def test_factories_and_copies_to_a_device_are_observed_by_the_unboxed_kernels() -> None:
    """The unboxed kernels of the operators CPU code calls most (Note [Unboxed observer kernels])
    run a call themselves only when it is host-only: a factory with a device argument and a copy
    to a device are launches like any other, so another pipeline's read of what they made waits
    for them (strict sim reports a race otherwise)."""
    p1, p2 = tp.Pipeline(), tp.Pipeline()
    src = torch.arange(float(N))
    makers: Dict[str, Any] = {
        "zeros": lambda: torch.zeros(N, device="sim:0"),
        "ones": lambda: torch.ones(N, device="sim:0"),
        "full": lambda: torch.full((N,), 3.0, device="sim:0"),
        "arange": lambda: torch.arange(0, N, 1, dtype=torch.float32, device="sim:0"),
        "empty + fill_": lambda: torch.empty(N, device="sim:0").fill_(2.0),
        "to(device)": lambda: src.to("sim:0"),
        "to(device, dtype)": lambda: src.to("sim:0", torch.float64),
    }
    for name, make in makers.items():
        with tp.pipeline(p1):
            x = make()
        with tp.pipeline(p2):
            y = x * 2
        assert sim.races() == [], name
        assert torch.equal(y.cpu(), make().cpu() * 2), name


def test_device_calls_of_the_listed_operators_are_observed_failing_ones_too() -> None:
    """A device call of a listed operator is observed by its unboxed kernel (arguments boxed on
    its frame, the op run unboxed): in-place ops, a scalar return (item), a copy; and a call that
    raises ends its observed op, so the thread's next ops are observed again (strict sim reports
    a race otherwise) and the error is the op's own."""
    p1, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.arange(float(N), device="sim:0")
    before = tp.tracking_stats()["ops"]
    with tp.pipeline(p1):
        y = torch.add(x, 1)           # add.Tensor: a fresh output on p1's stream
        y.mul_(2)                     # mul_.Scalar: in place
        z = torch.empty_like(y)
        z.copy_(y)                    # copy_
    with tp.pipeline(p2):
        total = z.sum().item()        # sum, then item: a Scalar return
    assert tp.tracking_stats()["ops"] - before >= 6
    assert total == float(((torch.arange(float(N)) + 1) * 2).sum())
    bad = torch.ones(3, device="sim:0")
    for _ in range(3):
        with tp.pipeline(p1):
            with pytest.raises(RuntimeError, match="size of tensor"):
                torch.add(y, bad)     # raises inside the observed op
            w = y + 1                 # observed again: p2's read below waits for it
        with tp.pipeline(p2):
            assert torch.equal(w.cpu(), (torch.arange(float(N)) + 1) * 2 + 1)
    assert sim.races() == []


def test_host_only_ops_are_counted_once_and_pay_no_launch() -> None:
    """A host-only call of a listed operator (torch.add of CPU tensors) counts as one observed op
    and launches nothing; the same call on device tensors is launched."""
    a, b = torch.ones(8), torch.ones(8)
    p = tp.Pipeline()
    stats = tp.tracking_stats()
    for _ in range(10):
        torch.add(a, b)
    after = tp.tracking_stats()
    assert after["ops"] - stats["ops"] == 10
    assert after["launches"] == stats["launches"]
    with tp.pipeline(p):
        torch.add(a.to("sim:0"), b.to("sim:0"))
    assert tp.tracking_stats()["launches"] > after["launches"]
    assert sim.races() == []


def _read_p_write_on(thread_body: Any, p: "tp.Pipeline") -> Dict[str, Any]:
    """p writes y; a thread runs thread_body(y) on the default stream; returns what it saw."""
    x = torch.ones(N, device="sim:0")
    with tp.pipeline(p):
        y = x * 3
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = thread_body(y)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    return box


@dispatcher_only
def test_a_thread_the_runtime_never_knew_is_warned_about_once_then_observed() -> None:
    """A thread without the key (as one started in C++) that runs device ops while tracking is
    live: its first device op is noticed by the sim backend, warned about once, counted; from then
    on the thread is observed (its later reads of another pipeline's writes are clean)."""
    idle()
    sim.set_strict(False)
    p = tp.Pipeline()
    before = tp.tracking_stats()["unobserved"]

    def body(y: torch.Tensor) -> Any:
        _C._forget_this_thread()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = (y + 1).cpu()       # unobserved: noticed, warned, may race
            sim.clear_races()
            states = _C._observer_key_state()
            with tp.pipeline(p):
                z = y * 2               # p writes ...
            second = (z + 1).cpu()      # ... and the default stream reads: observed now
        return first, second, states, [str(w.message) for w in caught]

    box = _read_p_write_on(body, p)
    assert "error" not in box, box.get("error")
    first, second, states, messages = box["value"]
    assert states == (True, False)
    assert torch.equal(second, torch.full((N,), 7.0))
    assert sim.races() == []
    unknown = [m for m in messages if "a thread the tracker did not know" in m]
    assert len(unknown) <= 1  # (warned once per process: an earlier test may have seen it)
    assert tp.tracking_stats()["unobserved"] - before == 1


@dispatcher_only
def test_a_thread_that_lost_its_key_is_warned_about_and_observed_again() -> None:
    """torch.inference_mode's exit restores the dispatch key set from before the block: a
    pipeline created inside it leaves the thread without the key. Its next device op is noticed,
    warned about (naming the cause), and the thread is observed again."""
    idle()
    sim.set_strict(False)
    x = torch.ones(N, device="sim:0")
    with torch.inference_mode():
        p = tp.Pipeline()
    assert _C._observer_key_state() == (False, False)
    before = tp.tracking_stats()["unobserved"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.ones(4, device="sim:0").add_(1)
    assert _C._observer_key_state() == (True, False)
    assert tp.tracking_stats()["unobserved"] - before == 1
    messages = [str(w.message) for w in caught]
    assert any("torch.inference_mode" in m for m in messages) or not messages  # (warned once)
    with tp.pipeline(p):
        y = x * 2
    assert torch.equal((y + 1).cpu(), torch.full((N,), 3.0))
    assert sim.races() == []


@dispatcher_only
def test_the_sampled_check_notices_a_thread_where_no_backend_checks() -> None:
    """Without the sim backend's check (CUDA has none), the sampled RecordFunction check notices
    a thread without the key (sampling every event here, 1/64 by default)."""
    idle()
    sim.set_strict(False)
    _C._set_unobserved_checks(1.0, False)
    try:
        p = tp.Pipeline()
        before = tp.tracking_stats()["unobserved"]

        def body(y: torch.Tensor) -> Any:
            _C._forget_this_thread()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (y + 1).cpu()
            return _C._observer_key_state()

        box = _read_p_write_on(body, p)
        assert box.get("value") == (True, False), box
        assert tp.tracking_stats()["unobserved"] > before
        del p
        idle()
    finally:
        _C._set_unobserved_checks(1.0 / 64, True)


@dispatcher_only
def test_the_sampled_check_is_installed_only_for_a_device_no_backend_checks() -> None:
    """The sampled check is a global RecordFunction callback, which costs every thread (a
    countdown per op, a rebuilt callback cache at each restore of a thread-local state), so it is
    installed only once the live period has a stream of a device type whose backend does not check
    its device ops (Note [The sampled check is installed on demand]): never on sim, which checks
    each op itself; with that check off (as on CUDA), at the first device op, until idle."""
    idle()
    x = torch.ones(N, device="sim:0")
    p = tp.Pipeline()
    with tp.pipeline(p):
        y = x * 2
    assert tp.tracking_stats()["ops"] > 0 and torch.equal(y.cpu(), torch.full((N,), 2.0))
    assert not _C._sampled_check_installed()
    del p, y
    idle()
    _C._set_unobserved_checks(1.0 / 64, False)
    try:
        p = tp.Pipeline()
        assert not _C._sampled_check_installed()  # (live, but no stream in the period yet)
        with tp.pipeline(p):
            y = x * 2
        assert _C._sampled_check_installed()
        assert torch.equal(y.cpu(), torch.full((N,), 2.0))
        del p, y
        idle()
        assert not _C._sampled_check_installed()
        p = tp.Pipeline()  # (a new period wants it again)
        with tp.pipeline(p):
            y = x + 1
        assert _C._sampled_check_installed()
        del p, y
        idle()
        assert not _C._sampled_check_installed()
    finally:
        _C._set_unobserved_checks(1.0 / 64, True)


@dispatcher_only
def test_a_thread_of_an_earlier_live_period_is_observed_in_the_next() -> None:
    """A thread observed in one live period lets go of the key when tracking goes idle (its next
    op); when tracking goes live again, the sweep of Python threads gives it back at the thread's
    next Python call, before its next op."""
    idle()
    go, done = threading.Event(), threading.Event()
    box: Dict[str, Any] = {"states": []}
    stop = False

    def body() -> None:
        try:
            while True:
                go.wait()
                go.clear()
                if stop:
                    return
                box["states"].append(_C._observer_key_state())
                if "y" in box:
                    box["z"] = box.pop("y") + 1    # the default stream reads p's write
                else:
                    torch.ones(4, device="sim:0").add_(1)
                done.set()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            box["error"] = e
            done.set()

    def turn() -> None:
        go.set()
        assert done.wait(timeout=60)
        done.clear()
        assert "error" not in box, box.get("error")

    t = threading.Thread(target=body)
    t.start()
    x = torch.ones(N, device="sim:0")
    for period in range(2):
        p = tp.Pipeline()                         # tracking goes live: the thread is swept
        turn()                                    # an op of its own, observed
        with tp.pipeline(p):
            box["y"] = x * (period + 2)
        turn()                                    # reads p's write: clean in strict mode
        assert torch.equal(box["z"].cpu(), torch.full((N,), period + 3.0))
        del p
        idle()
        turn()                                    # its first op while idle drops the key
    stop = True
    go.set()
    t.join(timeout=60)
    assert box["states"][:2] == [(True, False), (True, False)]
    assert box["states"][2] == (True, False)      # (dropped during this op, not before it)
    assert box["states"][3:5] == [(True, False), (True, False)]
    assert sim.races() == []


# ---- subclasses ---------------------------------------------------------------------------------
def test_dtensor_in_a_pipeline_on_strict_sim() -> None:
    """DTensor (a __torch_dispatch__ wrapper subclass): its ops run as ops on local shards
    inside __torch_dispatch__, where every dispatch key above Python is excluded; the tracker sees
    them there and orders them (strict mode raises otherwise). Untracked, the same program races."""
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(29400 + os.getpid() % 500)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("sim", [0])

        def program() -> List[torch.Tensor]:
            torch.manual_seed(0)
            w = DTensor.from_local(torch.randn(64, 64).to("sim:0"), mesh, [Shard(0)])
            x = DTensor.from_local(torch.randn(64, 64).to("sim:0"), mesh, [Replicate()])
            p = tp.Pipeline()
            with tp.pipeline(p):
                y = (w @ x).relu()                 # reads the default stream's writes
            z = y + 1                              # the default stream reads p's write
            return [z.to_local().cpu(), ((w.to_local() @ x.to_local()).relu() + 1).cpu()]

        unclaimed = tp.tracking_stats()["unclaimed"]
        got, reference = program()
        assert torch.equal(got, reference)
        assert sim.races() == []
        assert tp.tracking_stats()["unclaimed"] > unclaimed
        with untracked():
            program()
            assert sim.races(), "untracked, the pipeline's reads must race"
    finally:
        dist.destroy_process_group()


# ---- profilers ----------------------------------------------------------------------------------
def test_profiler_ranges_and_ops_are_recorded_on_every_thread_while_live() -> None:
    """The dispatcher path leaves RecordFunction alone: torch.profiler sees the ops and the
    record_function ranges of the main thread and of a task on a worker thread."""
    from torch.profiler import ProfilerActivity, profile, record_function

    p = tp.Pipeline(tp.get_worker_thread(1))
    x = torch.ones(N, device="sim:0")

    def task(t: torch.Tensor) -> torch.Tensor:
        with record_function("tp_test_task_range"):
            return t * 5

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("tp_test_main_range"):
            y = x + 1
        out = p.submit(task, y).wait()
    names = {e.name for e in prof.events()}
    assert {"tp_test_main_range", "tp_test_task_range", "aten::add", "aten::mul"} <= names
    assert torch.equal(out.cpu(), torch.full((N,), 10.0))
    assert sim.races() == []


# ---- the RecordFunction path ----------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import torch, torch_pipeline as tp, torch_pipeline.sim as sim
    sim.enable(num_devices=1, strict=True)
    x = torch.ones(64, device="sim:0")
    p = tp.Pipeline()
    with tp.pipeline(p):
        y = x * 2
    z = y + 1
    assert torch.equal(z.cpu(), torch.full((64,), 3.0))
    print(tp.tracking_stats()["observer"], tp.tracking_stats()["ops"] > 0, sim.races() == [])
""")


def _child(observer: str) -> "subprocess.CompletedProcess[str]":
    env = dict(os.environ, TORCH_PIPELINE_OBSERVER=observer)
    env.pop("TORCH_PIPELINE_SIM_TEST_CHILD", None)
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=120)


def test_torch_pipeline_observer_selects_the_path() -> None:
    for observer in ("dispatcher", "record_function"):
        r = _child(observer)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [observer, "True", "True"]


def test_a_bad_observer_name_raises_at_the_first_pipeline() -> None:
    r = _child("sampling")
    assert r.returncode != 0
    assert "TORCH_PIPELINE_OBSERVER must be 'dispatcher'" in r.stderr


def test_the_observer_cannot_change_while_live() -> None:
    p = tp.Pipeline()
    with pytest.raises(RuntimeError, match="cannot change while tracking is live"):
        _C._set_observer("record_function")
    del p


install_proxies(globals(), __file__)
