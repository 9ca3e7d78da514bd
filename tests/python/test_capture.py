"""Graph capture under pipelines on the sim device's capture twin (docs/design.md §4 "Graph
capture", §5 "Graph capture twin").

The twin behaves like CUDA's global capture mode where the tracker is concerned: while a capture
is underway any event or stream query and any host synchronization in the process raises and
invalidates it; a capturing stream that waits for an event recorded outside the capture raises;
a stream that waits for a captured event joins the capture, and ending a capture with a joined
stream the capturing stream never waited for raises. Captured ops are race-checked against what
the capture touched, and a replay is one op touching all of it. Each rule has a twin with the
tracker's capture handling off (``_C._set_capture_aware(False)``) or tracking off, which fails.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from typing import Any, Iterator, List

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch_pipeline import _C, _graphs

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


@contextlib.contextmanager
def capture_unaware() -> Iterator[None]:
    """The tracker ignores captures (polls go on, captured ops are tracked as if they ran)."""
    _C._set_capture_aware(False)
    try:
        yield
    finally:
        _C._set_capture_aware(True)


def stats() -> Any:
    return tp.tracking_stats()


def test_the_first_pipeline_installs_the_cuda_graph_hooks() -> None:
    tp.Pipeline()
    for name in ("capture_begin", "capture_end", "replay", "reset"):
        assert getattr(getattr(torch.cuda.CUDAGraph, name), "_torch_pipeline_hook", False), name


def _poll_from_another_thread(p2: Any, x: torch.Tensor) -> List[BaseException]:
    """Ops on p2 in another thread that use x off its allocation stream: each keeps x alive, and
    the launches after the first poll for it (an event query, unless polls are paused)."""
    errors: List[BaseException] = []

    def work() -> None:
        try:
            with tp.pipeline(p2):
                for _ in range(3):
                    (x * 2).sum()
        except BaseException as e:  # pragma: no cover - reported by the test
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return errors


def test_a_capture_in_a_pipeline_makes_no_device_query() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(1024, device="sim")  # on the default stream: used on p2, kept alive there
    y = torch.empty(1024, device="sim")
    g = sim.Graph()
    paused = stats()["polls_paused"]
    with tp.pipeline(p):
        with sim.graph(g):
            assert stats()["captures_underway"] == 1
            y.copy_(x * 2)
            assert _poll_from_another_thread(p2, x) == []
    assert stats()["captures_underway"] == 0
    assert stats()["polls_paused"] > paused  # the other thread's polls waited for the end
    with tp.pipeline(p):
        g.replay()
    assert sim.races() == []


def test_the_twin_without_paused_polls_fails_the_capture() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(1024, device="sim")
    y = torch.empty(1024, device="sim")
    g = sim.Graph()
    with capture_unaware(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tracker's callback warns of the failed queries)
        with pytest.raises(RuntimeError, match="invalidated by .*an event query"):
            with tp.pipeline(p):
                with sim.graph(g):
                    y.copy_(x * 2)
                    _poll_from_another_thread(p2, x)


def test_waits_inside_a_capture_are_captured_record_and_wait() -> None:
    p, p1, p2 = tp.Pipeline(), tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(p1):
        x = torch.full((256,), 3.0, device="sim")  # made outside the capture, on another stream
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    before = stats()
    with tp.pipeline(p):
        with sim.graph(g):
            y = x * 2                     # no wait for p1 here: that would be outside the capture
            with tp.pipeline(p2):
                z = y + 1                 # p2 is forked into the capture (an edge after y)
            out.copy_(z * y)              # waits for p2: a captured edge, which joins it back
    after = stats()
    assert after["capture_forks"] == before["capture_forks"] + 1
    assert after["capture_joins"] == before["capture_joins"]  # joined by the op's own wait
    assert after["waits"] >= before["waits"] + 2 and after["events"] >= before["events"] + 2
    assert sim.races() == []  # strict: every captured read was ordered after its captured write


def test_the_twin_unaware_of_captures_waits_outside_and_fails() -> None:
    p, p1 = tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(p1):
        x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with capture_unaware(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="invalidated by .*a wait for an event recorded "
                                               "outside it"):
            with tp.pipeline(p):
                with sim.graph(g):
                    out.copy_(x * 2)  # the tracker waits for p1's event: recorded outside


def test_untracked_side_work_is_not_captured_and_its_replay_races() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        with untracked():
            with sim.graph(g):
                y = x * 2
                with tp.pipeline(p2):
                    z = y + 1  # runs eagerly on p2: no wait forked it into the capture
                out.copy_(z * y)
            g.replay()  # reads z, which p2 wrote outside the graph, with no order between them
            assert any("sim graph replay" in str(r) for r in sim.races())


def test_a_side_pipeline_left_unjoined_is_joined_back_at_the_end() -> None:
    p, p2, p3 = tp.Pipeline(), tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    g = sim.Graph()
    joins = stats()["capture_joins"]
    with tp.pipeline(p):
        with sim.graph(g):
            y = x * 2
            with tp.pipeline(p2):
                z = y + 1  # nothing on the capturing stream reads z
    assert stats()["capture_joins"] == joins + 1  # joined before the end: the capture ended
    with tp.pipeline(p):
        g.replay()
    with tp.pipeline(p3):
        assert torch.equal(z.cpu(), torch.full((256,), 7.0))  # waits for the replay that writes z
    assert sim.races() == []


def test_without_the_tracker_a_side_stream_left_unjoined_fails_the_capture() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    side = p2.stream(torch.device("sim:0"))
    label = _C._sim_stream_label(side)
    g = sim.Graph()
    with untracked():
        with pytest.raises(RuntimeError, match="never waited for") as raised:
            with tp.pipeline(p):
                with sim.graph(g):
                    y = x * 2
                    side.wait_stream(torch.accelerator.current_stream())  # forked by hand
                    with tp.pipeline(p2):
                        y + 1  # ... and never joined back
    assert label in str(raised.value)


def test_storages_used_in_a_capture_stay_alive_while_the_graph_lives() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")  # made before the capture: every replay reads it
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            y = x * 2
            with tp.pipeline(p2):
                z = y + 1  # y is used off the stream it was allocated on
            out.copy_(z)
    x_ref, y_ref = StorageWeakRef(x.untyped_storage()), StorageWeakRef(y.untyped_storage())
    captured = _graphs.captured(g)
    assert captured is not None and captured.kept >= 3  # x, out, y (and z's of no stream of its own)
    del x, y, z, captured
    gc.collect()
    assert not x_ref.expired() and not y_ref.expired()
    del g
    gc.collect()
    assert x_ref.expired() and y_ref.expired()


def test_the_twin_unaware_of_captures_keeps_nothing_for_the_graph() -> None:
    p = tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with capture_unaware(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="invalidated"):  # (its waits are illegal too)
            with tp.pipeline(p):
                with sim.graph(g):
                    out.copy_(x * 2)
    assert _graphs.captured(g) is None
    x_ref = StorageWeakRef(x.untyped_storage())
    del x
    gc.collect()
    assert x_ref.expired()  # freed while the graph that reads it lives


def test_a_reset_graph_keeps_nothing() -> None:
    p = tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            out.copy_(x * 2)
    x_ref = StorageWeakRef(x.untyped_storage())
    del x
    g.reset()
    gc.collect()
    assert x_ref.expired()


def test_replays_are_ordered_against_the_streams_they_run_on() -> None:
    p, p1, p2, p3 = tp.Pipeline(), tp.Pipeline(), tp.Pipeline(), tp.Pipeline()
    x = torch.zeros(256, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            out.copy_(x * 2)
    replays = stats()["graph_replays"]
    with tp.pipeline(p1):
        x.fill_(3.0)          # the static input, written on p1
    with tp.pipeline(p2):
        g.replay()            # waits for p1's write, and writes out on p2
    with tp.pipeline(p3):
        out.sum()             # waits for the replay
    assert stats()["graph_replays"] == replays + 1
    assert sim.races() == []

    with untracked():
        with tp.pipeline(p1):
            x.fill_(4.0)
        with tp.pipeline(p2):
            g.replay()
        assert any("sim graph replay" in str(r) for r in sim.races())


def test_a_host_wait_during_a_capture_is_skipped_with_a_warning() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(256, device="sim")
    with tp.pipeline(p2):
        h = x.to("cpu", non_blocking=True)  # watched host memory, written on p2
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    paused = stats()["polls_paused"]
    with tp.pipeline(p):
        with pytest.warns(UserWarning, match="while a graph capture is underway"):
            with sim.graph(g):
                out.copy_(x * 2)
                h.sum()  # a CPU op on it: no synchronization is allowed now
    assert stats()["polls_paused"] > paused


def test_the_twin_unaware_of_captures_synchronizes_and_fails_the_capture() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(256, device="sim")
    with tp.pipeline(p2):
        h = x.to("cpu", non_blocking=True)
    g = sim.Graph()
    with capture_unaware(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="invalidated by .*an event synchronize"):
            with tp.pipeline(p):
                with sim.graph(g):
                    h.sum()


def test_tracking_stays_live_through_a_capture_and_goes_idle_after() -> None:
    gc.collect()
    assert not _C._tracking_live()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with sim.graph(g):
        p2 = tp.Pipeline()   # goes live inside the capture (no event on the capturing stream)
        with tp.pipeline(p2):
            z = x * 2
        del p2               # the last pipeline dies: going idle waits for the capture's end
        gc.collect()
        assert _C._tracking_live()
        out.copy_(z)
    gc.collect()
    assert not _C._tracking_live()
    assert sim.races() == []


def test_a_capture_begun_without_the_hooks_is_detected_at_its_ops() -> None:
    p, p1 = tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(p1):
        x = torch.full((256,), 3.0, device="sim")
    stream = _C._sim_stream_from_pool(0, False)
    captures = stats()["captures"]
    with tp.pipeline(p):
        previous = torch.accelerator.current_stream()
        torch.accelerator.set_stream(stream)
        _C._sim_begin_capture(stream)  # as an extension calling cudaStreamBeginCapture would
        try:
            y = x * 2                  # captured: no wait for p1 (outside the capture)
        finally:
            _C._sim_end_capture(stream)
            torch.accelerator.set_stream(previous)
        assert stats()["captures"] == captures + 1
        with pytest.warns(UserWarning, match="begun without torch.cuda.graph"):
            y + 1                      # the next op sees the capture over
    assert stats()["captures_underway"] == 0
    assert sim.races() == []


install_proxies(globals(), __file__)
