"""The kept part (``KeptStorages``, csrc/runtime/tracking/kept_storages.h): storages used off the
stream that made them, kept alive per stream of use until that use completes (allocator safety,
the default). Its count is kept by the part itself and must equal the storages in its queues at
every moment, also while many threads launch, keep and release at once; a storage used only on
its own stream is never kept; what is kept is let go of once the use completes, by a later launch
or a synchronization, and the queues of a period go with it.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import gc
import threading

import torch

from _parts import part
from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    from torch_pipeline import _C

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def test_a_storage_used_only_where_it_was_made_is_never_kept() -> None:
    p = tp.Pipeline()
    with tp.pipeline(p):
        for _ in range(200):
            x = torch.ones(64, device="sim:0")
            y = x * 2 + 1
            del x, y
    assert part("kept") == {"count": 0, "queued": 0, "streams": 0}


def test_a_storage_used_on_another_stream_is_kept_until_that_use_completes() -> None:
    p, q = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(64, device="sim:0")          # made on the default stream
    with tp.pipeline(p):
        y = x * 2                               # used on p's
    with tp.pipeline(q):
        z = x + 1                               # and on q's
    del x
    kept = part("kept")         # (q's launch may have let go of p's use already: it is done)
    assert kept["count"] == kept["queued"] >= 1 and kept["streams"] >= 1
    tp.synchronize()                            # both uses complete: let go of
    assert part("kept") == {"count": 0, "queued": 0, "streams": 0}
    assert torch.equal((y + z).cpu(), torch.full((64,), 4.0))


def test_its_count_equals_its_queues_while_many_threads_keep_and_release() -> None:
    pipelines = [tp.Pipeline() for _ in range(4)]
    shared = [torch.ones(32, device="sim:0") for _ in range(8)]
    stop = threading.Event()
    errors = []
    samples = []

    def worker(i: int) -> None:
        try:
            for n in range(150):
                x = torch.full((32,), float(n), device="sim:0")     # default stream
                with tp.pipeline(pipelines[i]):
                    y = x + shared[n % len(shared)]                  # x kept for this use
                del x
                assert y[0].item() == n + 1.0
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def sampler() -> None:
        while not stop.is_set():
            samples.append(part("kept"))

    s = threading.Thread(target=sampler)
    s.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    s.join()
    assert errors == []
    assert len(samples) > 10 and any(k["count"] > 0 for k in samples)
    assert all(k["count"] == k["queued"] for k in samples), [
        k for k in samples if k["count"] != k["queued"]][:3]
    tp.synchronize()
    assert part("kept") == {"count": 0, "queued": 0, "streams": 0}
    stats = _C._tracking_stats()
    assert stats["keep_alives"] == stats["released"] > 0


def test_the_queues_of_a_period_go_when_it_ends() -> None:
    p = tp.Pipeline()
    x = torch.ones(64, device="sim:0")
    with tp.pipeline(p):
        y = x * 2
    del x
    assert part("kept")["count"] == 1
    del p
    gc.collect()                                # idle: the period's state goes
    assert not _C._tracking_stats()["live"]
    assert part("kept") == {"count": 0, "queued": 0, "streams": 0}
    assert torch.equal(y.cpu(), torch.full((64,), 2.0))


install_proxies(globals(), __file__)
