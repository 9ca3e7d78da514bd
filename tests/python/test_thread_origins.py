"""Threads the runtime did not start are observed like its own, whenever they began.

The tracker sees every thread's ops (its RecordFunction callback is global), so a thread needs no
registration: one started and already running sim ops before the first pipeline existed, the
threads of a ``concurrent.futures`` pool made before it, and a ``threading.Thread`` started inside
``with tp.pipeline(p):`` (which runs on the default stream: the current pipeline is the thread's
own). Each program below reads on one thread what another wrote on another stream, with no manual
synchronization: tracked, it runs clean in strict mode and gives the right values; untracked (the
twin), it races.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import concurrent.futures
import gc
import threading
from typing import Callable, Dict

import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch_pipeline import _C


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=1)

N = 1 << 14


def assert_idle() -> None:
    gc.collect()
    assert not _C._tracking_live(), "a pipeline of an earlier test is still alive"


def then_read_on(p: "tp.Pipeline", t: torch.Tensor) -> torch.Tensor:
    with tp.pipeline(p):
        return (t * 1).cpu()


def clean_tracked_racing_untracked(program: Callable[[int], Callable[[], None]], from_idle: bool,
                                   why: str) -> None:
    """program(20) runs clean in strict mode (from idle tracking when ``from_idle``: no pipeline
    alive before it); program(3) untracked races (``why`` says what)."""
    if from_idle:
        assert_idle()
    program(20)()
    assert sim.races() == []
    if from_idle:
        assert_idle()
    with untracked():
        program(3)()
        assert sim.races(), why


# ---- a thread that ran sim ops before the first pipeline -------------------------------------------
def thread_from_before(rounds: int) -> Callable[[], None]:
    def program() -> None:
        x = torch.ones(N, device="sim:0")
        go, done = threading.Event(), threading.Event()
        box: Dict[str, torch.Tensor] = {}
        errors = []

        def body() -> None:
            try:
                torch.ones(8, device="sim:0").add_(1)  # seen by torch before any pipeline
                for _ in range(rounds):
                    go.wait()
                    go.clear()
                    z = box["y"] + 1                  # the default stream reads p's write
                    z.mul_(3)
                    box["z"] = z
                    done.set()
            except BaseException as e:  # noqa: BLE001 - reported to the test
                errors.append(e)
                done.set()

        t = threading.Thread(target=body)
        t.start()
        p = tp.Pipeline()                              # tracking goes live after the thread began
        for _ in range(rounds):
            with tp.pipeline(p):
                box["y"] = x * 2
            go.set()
            done.wait(timeout=60)
            done.clear()
            assert not errors, repr(errors[0])
            assert torch.equal(then_read_on(p, box["z"]), torch.full((N,), 9.0))  # p reads it back
        t.join(timeout=60)
        assert not t.is_alive()
        assert not errors, repr(errors[0])
    return program


def test_a_thread_running_before_the_first_pipeline_is_observed() -> None:
    clean_tracked_racing_untracked(thread_from_before, True,
                                   "untracked, the thread's read of p's write must race")


# ---- a concurrent.futures pool made before the first pipeline --------------------------------------
def pool_from_before(rounds: int) -> Callable[[], None]:
    def program() -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            # Every pool thread runs a sim op before any pipeline exists.
            warm = threading.Barrier(2)
            list(pool.map(lambda _: (warm.wait(), torch.zeros(8, device="sim:0").add_(1)),
                          range(2)))
            p = tp.Pipeline()
            x = torch.arange(N, dtype=torch.float32, device="sim:0")
            for k in range(rounds):
                with tp.pipeline(p):
                    y = x + k                          # p writes
                # (exact arithmetic: a transcendental op's CPU result may depend on which
                # thread runs it, MKL's internal threading on a fresh thread)
                z = pool.submit(lambda: y * 3 - 1).result()  # a pool thread reads, writes z
                w = pool.submit(lambda: z.mul_(2)).result()  # another write, maybe another thread
                expected = ((torch.arange(N, dtype=torch.float32) + k) * 3 - 1) * 2
                assert torch.equal(then_read_on(p, w), expected)
    return program


def test_a_concurrent_futures_pool_made_before_the_first_pipeline_is_observed() -> None:
    clean_tracked_racing_untracked(pool_from_before, True,
                                   "untracked, the pool threads' reads of p's writes must race")


# ---- a threading.Thread started inside `with p:` ---------------------------------------------------
def thread_inside_pipeline(rounds: int) -> Callable[[], None]:
    def program() -> None:
        p = tp.Pipeline()
        x = torch.ones(N, device="sim:0")
        default = torch.accelerator.current_stream()   # (no pipeline entered: the default stream)
        for k in range(rounds):
            box: Dict[str, object] = {}
            with tp.pipeline(p):
                assert torch.accelerator.current_stream() != default
                y = x * (k + 1)                        # p writes

                def body() -> None:
                    try:
                        box["stream"] = torch.accelerator.current_stream()
                        box["z"] = y.neg()             # the default stream reads p's write
                    except BaseException as e:  # noqa: BLE001 - reported to the test
                        box["error"] = e

                t = threading.Thread(target=body)
                t.start()
                t.join(timeout=60)
                assert not t.is_alive() and "error" not in box, box.get("error")
                # The new thread's current stream is its own: the device's default stream.
                assert box["stream"] == default
                z = box["z"]
                assert isinstance(z, torch.Tensor)
                z.add_(1)                              # p writes what the thread wrote
            assert torch.equal(then_read_on(p, z), torch.full((N,), -float(k)))
    return program


def test_a_thread_started_inside_a_pipeline_context_is_observed() -> None:
    clean_tracked_racing_untracked(thread_inside_pipeline, False,
                                   "untracked, the thread's read of p's write must race")


install_proxies(globals(), __file__)
