"""What a task is given and what it returns, on the sim device in strict mode.

* Results: a task's future carries any Python value (a generator, a lambda, a Pipeline, tensors
  nested in containers), without pickling it; ``wait()`` still orders the waiter after the task's
  device work (strict sim raises on any unordered access).

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc
import threading
from typing import Any, Dict, Iterator

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

N = 1024


@pytest.fixture(scope="module", autouse=True)
def _sim_enabled() -> Iterator[None]:
    if IN_CHILD:
        sim.enable(num_devices=2)
    yield


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    """Each test starts strict, tracked, with a synchronized host."""
    if not IN_CHILD:
        yield
        return

    def reset() -> None:
        gc.collect()
        _C._set_tracking_enabled(True)
        sim.synchronize(0)
        sim.synchronize(1)
        sim.clear_races()
        sim.set_strict(True)

    reset()
    yield
    sim.set_strict(False)
    reset()


# ---- results of any type -------------------------------------------------------------------------
def test_a_task_may_return_a_generator() -> None:
    fut = tp.Pipeline(tp.get_worker_thread(1)).submit(lambda: (i * i for i in range(4)))
    assert list(fut.wait()) == [0, 1, 4, 9]


def test_a_task_may_return_a_pipeline_a_lambda_or_any_unpicklable_object() -> None:
    p = tp.Pipeline(tp.get_worker_thread(1))
    q = tp.Pipeline(tp.get_worker_thread(2))
    assert p.submit(lambda: q).wait() is q
    assert p.submit(lambda: (lambda v: v + 1)).wait()(1) == 2
    lock = threading.Lock()
    assert p.submit(lambda: lock).wait() is lock
    fut = p.submit(lambda: tp.Pipeline(tp.get_worker_thread(2)))
    assert isinstance(fut.wait(), tp.Pipeline)
    assert fut.value() is fut.wait()


def test_nested_tensors_returned_in_a_dict_are_ready_after_wait() -> None:
    """The task's device work is ordered before the waiter's use of the result (strict sim raises
    otherwise), with no pickling of the result."""
    p = tp.Pipeline(tp.get_worker_thread(1))

    def make() -> Dict[str, Any]:
        a = torch.full((N,), 2.0, device="sim:0")
        b = a * 3
        return {"a": a, "nested": {"list": [b, (a + 1, b.sub_(1))], "gen": (i for i in [a])}}

    for _ in range(5):
        out = p.submit(make).wait()
        assert out["a"].sum().item() == 2.0 * N                    # read on the main thread's
        assert (out["nested"]["list"][0] * 1).sum().item() == 5.0 * N  # default stream
        assert out["nested"]["list"][1][0].sum().item() == 3.0 * N
        assert next(out["nested"]["gen"]) is out["a"]
        out["a"].add_(1)  # a write after the task's reads and writes
    assert sim.races() == []


install_proxies(globals(), __file__)
