"""Graph capture under pipelines on the sim device's capture twin (docs/design.md, "Graph capture"
and "Graph capture twin").

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
    cls = torch.cuda.CUDAGraph
    # (torch >= 2.14 ends a capture in capture_end_pre, which capture_end calls: that is wrapped)
    end = "capture_end_pre" if "capture_end_pre" in cls.__dict__ else "capture_end"
    for name in ("capture_begin", end, "replay", "reset"):
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
    out = torch.empty(256, device="sim")       # ... and writes this
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            y = x * 2
            with tp.pipeline(p2):
                z = y + 1  # y is used off the stream it was born on; z is born on p2 ...
            w = z * 3      # ... and used on the capturing stream; w is born and used there
            out.copy_(w)
    refs = {name: StorageWeakRef(t.untyped_storage()) for name, t in
            (("x", x), ("out", out), ("y", y), ("z", z), ("w", w))}
    captured = _graphs.captured(g)
    assert captured is not None and captured.kept == 4  # x, out, y, z (not w)
    del x, out, y, z, w, captured
    gc.collect()
    assert {name for name, ref in refs.items() if not ref.expired()} == {"x", "out", "y", "z"}
    del g
    gc.collect()
    assert all(ref.expired() for ref in refs.values())


def test_a_tensor_born_early_in_a_capture_is_not_kept_after_many_outputs() -> None:
    # The young ring (the 64 latest outputs) forgets t before its next use: whether it was born in
    # the capture is the ledger's to say, not the storage table's.
    p = tp.Pipeline()
    x = torch.full((16,), 1.0, device="sim")
    out = torch.empty(16, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            t = x * 2                  # born in the capture, on the capturing stream
            for _ in range(80):
                x * 3                  # more than 64 other outputs
            out.copy_(t)               # t used again, on the stream it was born on
    t_ref = StorageWeakRef(t.untyped_storage())
    captured = _graphs.captured(g)
    assert captured is not None and captured.kept == 2  # x and out only
    del t, captured
    gc.collect()
    assert t_ref.expired()  # left to the graph's pool, not kept for the graph's lifetime


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


def test_the_op_path_asks_no_device_about_captures_while_none_is_underway() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(256, device="sim")
    before = _C._sim_capture_probes()
    with tp.pipeline(p):
        y = x * 2
        with tp.pipeline(p2):
            z = torch.zeros(256, device="sim") + y  # (a factory too)
    z.sum()
    assert _C._sim_capture_probes() == before
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            y.mul_(2)
    assert _C._sim_capture_probes() > before  # (during a capture it asks)


def test_a_capture_begun_without_the_hooks_fails_loudly_with_what_to_do() -> None:
    # Not supported while a pipeline is alive: the tracker does not see it, so a keep-alive poll
    # queries an event while it is underway, which fails it; the failure says what to do.
    p2 = tp.Pipeline()
    x = torch.ones(1024, device="sim")  # on the default stream: used on p2, kept alive there
    stream = _C._sim_stream_from_pool(0, False)
    captures = stats()["captures"]
    _C._sim_begin_capture(stream)  # as an extension calling cudaStreamBeginCapture would
    try:
        with pytest.warns(UserWarning, match="torch.cuda.graph / CUDAGraph.capture_begin"):
            with tp.pipeline(p2):
                for _ in range(3):
                    (x * 2).sum()  # polls for x: the query raises (the capture is invalidated)
    finally:
        with pytest.raises(RuntimeError, match="invalidated by an event query"):
            _C._sim_end_capture(stream)
    assert stats()["captures"] == captures  # (not detected: nothing was registered)
    with tp.pipeline(p2):
        (x * 2).sum()
    tp.synchronize()  # (the next polls let x go)


def test_a_factory_on_a_side_pipeline_is_captured_not_run_eagerly() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    forks = stats()["capture_forks"]
    with tp.pipeline(p):
        with sim.graph(g):
            y = x * 2
            with tp.pipeline(p2):
                acc = torch.zeros(256, device="sim")  # p2's first op in the capture: a factory
                acc.add_(y)
            out.copy_(acc)
    assert stats()["capture_forks"] == forks + 1
    assert g.eager_ops == []  # (else the zeros ran once, at capture time, outside the graph)
    side = _C._sim_stream_label(p2.stream(torch.device("sim:0")))
    assert any(op.endswith(" on " + side) for op in g.captured_ops[:2]), g.captured_ops
    with tp.pipeline(p):
        g.replay()
    assert torch.equal(out.cpu(), torch.full((256,), 6.0))
    assert sim.races() == []


def test_the_twin_shows_side_work_run_outside_the_capture() -> None:
    p, p2 = tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        with untracked():
            with sim.graph(g):
                y = x * 2
                with tp.pipeline(p2):
                    torch.zeros(256, device="sim")  # not forked in: run now, on p2
                y.add_(1)
    side = _C._sim_stream_label(p2.stream(torch.device("sim:0")))
    assert any(op.endswith(" on " + side) for op in g.eager_ops), g.eager_ops
    assert not any(op.endswith(" on " + side) for op in g.captured_ops)


def _begin(g: Any, stream: torch.Stream) -> torch.Stream:
    """Begins capturing g on stream (made current), without sim.graph's synchronize; returns the
    stream that was current."""
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(stream)
    g.capture_begin()
    return previous


def _gate_open() -> bool:
    return stats()["captures_underway"] == 0 and stats()["queries_paused"] == 0


def test_a_failed_capture_begin_leaves_no_pause() -> None:
    p = tp.Pipeline()  # (tracking live)
    g = sim.Graph()
    default = torch.accelerator.current_stream()  # (a default stream: the begin raises)
    with pytest.raises(RuntimeError, match="non-default stream"):
        with sim.graph(g, stream=default):
            pass
    assert _gate_open()
    with tp.pipeline(p):
        with sim.graph(g):  # (and a capture works after it)
            assert stats()["captures_underway"] == 1
    assert _gate_open()


def test_an_exception_in_the_capture_body_leaves_no_pause() -> None:
    p = tp.Pipeline()
    x = torch.ones(256, device="sim")
    g = sim.Graph()
    with pytest.raises(ValueError, match="in the body"):
        with tp.pipeline(p):
            with sim.graph(g):
                x.mul_(2)
                raise ValueError("in the body")
    assert _gate_open()


def test_a_failed_capture_end_leaves_no_pause() -> None:
    p = tp.Pipeline()
    x = torch.ones(256, device="sim")
    g = sim.Graph()
    with pytest.raises(RuntimeError, match="invalidated"):  # the device's end raises ...
        with tp.pipeline(p):
            with sim.graph(g):
                x.mul_(2)
                with pytest.raises(RuntimeError, match="not permitted"):
                    x.sum().item()  # ... for this host synchronization inside the capture
    assert _gate_open()


class StandInGraph:
    """Stands in for torch.cuda.CUDAGraph on the sim twin: capture_begin / capture_end on the
    current stream, replay, reset (which fails when ``fail_reset``)."""

    def __init__(self) -> None:
        self.graph: Any = None
        self.stream: Any = None
        self.fail_reset = False

    def capture_begin(self) -> None:
        self.stream = torch.accelerator.current_stream()
        _C._sim_begin_capture(self.stream)

    def capture_end(self) -> None:
        self.graph = _C._sim_end_capture(self.stream)

    def replay(self) -> None:
        self.graph.replay(torch.accelerator.current_stream())

    def reset(self) -> None:
        if self.fail_reset:
            raise RuntimeError("the reset failed")
        self.graph = None


def stand_in_class(current_stream: Any = None) -> type:
    """A fresh subclass of StandInGraph with its methods wrapped as install_cuda_graph_hooks wraps
    torch.cuda.CUDAGraph's (current_stream: what the wrappers take for the capture's stream)."""
    cls = type("Wrapped", (StandInGraph,), {
        name: (lambda f: lambda self: f(self))(getattr(StandInGraph, name))
        for name in ("capture_begin", "capture_end", "replay", "reset")})
    _graphs.install_graph_hooks(cls, current_stream or torch.accelerator.current_stream)
    return cls


def test_the_graph_wrappers_capture_join_keep_and_order_replays() -> None:
    cls = stand_in_class()
    for name in ("capture_begin", "capture_end", "replay", "reset"):
        assert getattr(cls.__dict__[name], "_torch_pipeline_hook", False), name
    p, p2, p3 = tp.Pipeline(), tp.Pipeline(), tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = cls()
    joins = stats()["capture_joins"]
    with tp.pipeline(p):
        previous = _begin(g, _C._sim_stream_from_pool(0, False))
        try:
            y = x * 2
            with tp.pipeline(p2):
                z = y + 1  # forked in; nothing on the capturing stream reads it
            out.copy_(y)
        finally:
            g.capture_end()
            torch.accelerator.set_stream(previous)
    assert stats()["capture_joins"] == joins + 1
    captured = _graphs.captured(g)
    assert captured is not None and captured.kept == 3  # x, out, y (used on p2)
    with tp.pipeline(p3):
        x.fill_(4.0)
    with tp.pipeline(p):
        g.replay()  # waits for p3's write of x
    with tp.pipeline(p2):
        out.sum()   # waits for the replay
    assert sim.races() == []
    g.reset()
    assert _graphs.captured(g) is None


def test_the_wrappers_take_capture_end_pre_where_the_class_has_it() -> None:
    class PreGraph(StandInGraph):  # (torch 2.14's CUDAGraph: capture_end calls capture_end_pre)
        capture_begin = StandInGraph.capture_begin
        replay = StandInGraph.replay
        reset = StandInGraph.reset

        def capture_end_pre(self) -> None:
            self.graph = _C._sim_end_capture(self.stream)

        def capture_end(self) -> None:
            self.capture_end_pre()

    _graphs.install_graph_hooks(PreGraph, torch.accelerator.current_stream)
    assert getattr(PreGraph.__dict__["capture_end_pre"], "_torch_pipeline_hook", False)
    assert not getattr(PreGraph.__dict__["capture_end"], "_torch_pipeline_hook", False)
    p = tp.Pipeline()  # (tracking live)
    g = PreGraph()
    previous = _begin(g, _C._sim_stream_from_pool(0, False))
    g.capture_end()
    torch.accelerator.set_stream(previous)
    assert _graphs.captured(g) is not None and _gate_open()
    del p


def test_a_tracker_failure_after_the_device_began_leaves_no_pause() -> None:
    # The stream the wrapper names is one sim never made: registering the capture raises after the
    # device began (and after the prepare's pause): the pause must end all the same.
    bogus = torch.Stream(stream_id=12345, device_index=0,
                         device_type=torch.accelerator.current_stream().device_type)
    cls = stand_in_class(current_stream=lambda: bogus)
    p = tp.Pipeline()  # (tracking live)
    g = cls()
    real = _C._sim_stream_from_pool(0, False)
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(real)
    try:
        with pytest.raises((RuntimeError, ValueError)):
            g.capture_begin()
        assert _gate_open()
    finally:
        _C._sim_end_capture(real)  # (the device's capture, begun by the stand-in)
        torch.accelerator.set_stream(previous)
    del p


def test_a_reset_that_fails_keeps_what_the_graph_uses() -> None:
    cls = stand_in_class()
    p = tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = cls()
    with tp.pipeline(p):
        previous = _begin(g, _C._sim_stream_from_pool(0, False))
        out.copy_(x * 2)
        g.capture_end()
        torch.accelerator.set_stream(previous)
    x_ref = StorageWeakRef(x.untyped_storage())
    del x
    g.fail_reset = True
    with pytest.raises(RuntimeError, match="the reset failed"):
        g.reset()
    gc.collect()
    assert not x_ref.expired()  # the graph still exists: so does what it reads
    g.fail_reset = False
    g.reset()
    gc.collect()
    assert x_ref.expired()


def test_replaying_a_graph_the_tracker_did_not_see_warns_once() -> None:
    cls = type("Late", (StandInGraph,), {})  # captured before its class is wrapped
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = cls()
    with untracked():  # (as before the first pipeline)
        previous = _begin(g, _C._sim_stream_from_pool(0, False))
        out.copy_(x * 2)
        g.capture_end()
        torch.accelerator.set_stream(previous)
    for name in ("capture_begin", "capture_end", "replay", "reset"):
        setattr(cls, name, getattr(StandInGraph, name))
    _graphs.install_graph_hooks(cls, torch.accelerator.current_stream)  # (the first pipeline's)
    p = tp.Pipeline()
    _graphs._unordered_warned = False
    with pytest.warns(UserWarning, match="replay is not ordered"):
        g.replay()  # (on the stream x was made on: ordered by chance, not by the tracker)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.replay()  # (once)
    del p


def test_a_capture_may_end_on_another_thread() -> None:
    p = tp.Pipeline()
    x = torch.full((256,), 3.0, device="sim")
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    with tp.pipeline(p):
        previous = _begin(g, _C._sim_stream_from_pool(0, False))
        out.copy_(x * 2)
        torch.accelerator.set_stream(previous)
    errors: List[BaseException] = []

    def end() -> None:
        try:
            g.capture_end()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=end)
    t.start()
    t.join()
    assert errors == []
    assert _gate_open()
    assert _graphs.captured(g) is not None and _graphs.captured(g).kept == 2
    g2 = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g2):  # this thread captures again (its old capture is over)
            out.add_(1)
    assert _gate_open()


def test_tracking_stays_live_between_prepare_and_begun() -> None:
    gc.collect()
    p = tp.Pipeline()
    assert _C._tracking_live()
    stream = _C._sim_stream_from_pool(0, False)
    _C._capture_prepare(stream)  # (the queries pause: a capture is about to begin)
    try:
        del p
        gc.collect()
        assert _C._tracking_live()  # going idle would record and wait for events
    finally:
        _C._capture_abandoned()
    gc.collect()
    assert not _C._tracking_live()
    assert _gate_open()


def test_another_threads_reader_does_not_record_into_a_capture_on_its_stream() -> None:
    p, p1, p3 = tp.Pipeline(), tp.Pipeline(), tp.Pipeline()
    x = torch.empty(256, device="sim")

    def write() -> None:  # a thread whose run on p1 never ends: no event after its write
        with tp.pipeline(p1):
            x.fill_(5.0)

    t = threading.Thread(target=write)
    t.start()
    t.join()
    out = torch.empty(256, device="sim")
    g = sim.Graph()
    read: List[BaseException] = []

    def reader() -> None:  # eager, on p3: waits for p1's write, outside the capture
        try:
            with tp.pipeline(p3):
                out.copy_(x * 2)
        except BaseException as e:  # pragma: no cover - reported below
            read.append(e)

    with tp.pipeline(p):
        previous = _begin(g, p1.stream(torch.device("sim:0")))  # a capture on p1's stream
        try:
            out.add_(0)
            r = threading.Thread(target=reader)
            r.start()
            r.join()
        finally:
            g.capture_end()  # raises if p3 joined the capture (never joined back)
            torch.accelerator.set_stream(previous)
    assert read == []
    assert not any("(captured)" in str(race) for race in sim.races())
    assert torch.equal(out.cpu(), torch.full((256,), 10.0))


def test_another_threads_reader_does_not_record_into_a_forked_side_stream() -> None:
    p, p2, p3 = tp.Pipeline(), tp.Pipeline(), tp.Pipeline()
    x = torch.empty(256, device="sim")

    def write() -> None:
        with tp.pipeline(p2):
            x.fill_(5.0)

    t = threading.Thread(target=write)
    t.start()
    t.join()
    out = torch.empty(256, device="sim")
    y = torch.ones(256, device="sim")
    g = sim.Graph()
    read: List[BaseException] = []

    def reader() -> None:
        try:
            with tp.pipeline(p3):
                out.copy_(x * 2)
        except BaseException as e:  # pragma: no cover - reported below
            read.append(e)

    with tp.pipeline(p):
        previous = _begin(g, _C._sim_stream_from_pool(0, False))
        try:
            with tp.pipeline(p2):
                y.mul_(2)  # p2 is forked into the capture
            r = threading.Thread(target=reader)
            r.start()
            r.join()
        finally:
            g.capture_end()
            torch.accelerator.set_stream(previous)
    assert read == []
    assert torch.equal(out.cpu(), torch.full((256,), 10.0))


def test_an_op_on_another_captures_stream_is_an_error_at_the_capture_end() -> None:
    p = tp.Pipeline()
    x = torch.ones(256, device="sim")
    mine, theirs = sim.Graph(), sim.Graph()
    other = _C._sim_stream_from_pool(0, False)
    began, done = threading.Event(), threading.Event()

    def capture_theirs() -> None:
        previous = _begin(theirs, other)
        began.set()
        done.wait(30)
        theirs.capture_end()
        torch.accelerator.set_stream(previous)

    t = threading.Thread(target=capture_theirs)
    t.start()
    began.wait(30)
    try:
        with pytest.raises(RuntimeError, match="capturing into another graph"):
            with tp.pipeline(p):
                previous = _begin(mine, _C._sim_stream_from_pool(0, False))
                try:
                    torch.accelerator.set_stream(other)
                    with pytest.warns(UserWarning, match="capturing into another graph"):
                        x * 2
                finally:
                    mine.capture_end()
                    torch.accelerator.set_stream(previous)
    finally:
        done.set()
        t.join()
    assert _gate_open()


def test_a_default_stream_cannot_join_a_capture() -> None:
    p = tp.Pipeline()  # (tracking live; the capture itself is outside any pipeline)
    on_1 = torch.ones(256, device="sim:1")
    g = sim.Graph()
    with pytest.raises(RuntimeError, match="the default stream of sim:1"):
        with sim.graph(g):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the op's own warning says the same)
                on_1 * 2  # sim:1's current stream is its default stream: not forked in
    assert _gate_open()

install_proxies(globals(), __file__)
