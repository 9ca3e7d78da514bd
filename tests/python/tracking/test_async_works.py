"""The async_works part (``AsyncWorks``, csrc/runtime/tracking/async_works.h, with a lock of its
own): the Work of each async collective and the tensors it writes, from the collective's end
until ``work.wait()`` tells the tracker where they are ready; at most ``kKept`` works (the oldest
forgotten first, so a program that never waits cannot grow it), and none once the period ends.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc
import threading

import torch

from _parts import part
from _sim_child import IN_CHILD, fake_process_group, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch.distributed as dist
    import torch_pipeline as tp
    from torch_pipeline import _C

KEPT = 1024  # AsyncWorks::kKept

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=1)


def test_a_work_is_kept_from_its_collective_until_it_is_waited_for() -> None:
    fake_process_group()
    p = tp.Pipeline()
    x = torch.ones(16, device="sim:0")
    with tp.collective():
        work = dist.all_reduce(x, async_op=True)
    assert part("async_works")["works"] == 1
    with tp.pipeline(p):
        work.wait()
    assert part("async_works")["works"] == 0
    work.wait()                                 # a second wait: unknown now, ignored
    assert part("async_works")["works"] == 0


def test_works_never_waited_for_stay_bounded() -> None:
    fake_process_group()
    p = tp.Pipeline()
    x = torch.ones(16, device="sim:0")
    works = []
    for _ in range(KEPT + 100):
        with tp.collective():
            works.append(dist.all_reduce(x, async_op=True))
    assert part("async_works")["works"] == KEPT
    del works, p
    gc.collect()                                # idle: the period's works go
    assert not _C._tracking_stats()["live"]
    assert part("async_works")["works"] == 0


def test_works_from_many_threads_are_each_kept_once() -> None:
    fake_process_group()
    pipelines = [tp.Pipeline() for _ in range(4)]
    errors = []

    def worker(i: int) -> None:
        try:
            x = torch.ones(16, device="sim:0")
            for _ in range(50):
                with tp.pipeline(pipelines[i]):
                    with tp.collective():
                        work = dist.all_reduce(x, async_op=True)
                    work.wait()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert part("async_works")["works"] == 0


install_proxies(globals(), __file__)
