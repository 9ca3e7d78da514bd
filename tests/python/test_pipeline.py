"""The Pipeline API promises of docs/design.md, "Concepts" and
"The Python API and the rules users rely on", that hold on any machine (CPU here)."""
from __future__ import annotations

import gc
import threading
import time
from typing import Any, Iterator

import pytest
import torch

import oneflow_pipeline
import torch_pipeline as tp

TIMEOUT = 30.0


def wait_for(cond: Any, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


# ---- slots -----------------------------------------------------------------------------------
def test_lifetime_disjoint_pipelines_reuse_the_smallest_slot() -> None:
    a = tp.Pipeline()
    first = a.id
    del a
    gc.collect()
    b = tp.Pipeline()
    assert b.id == first
    c = tp.Pipeline()
    assert c.id == first + 1
    d = tp.Pipeline()
    assert d.id == first + 2
    del c  # frees the middle slot: the next pipeline takes it, not a new one
    e = tp.Pipeline()
    assert e.id == first + 1
    del b, d, e


def test_live_pipelines_get_distinct_slots() -> None:
    live = [tp.Pipeline() for _ in range(50)]
    ids = [p.id for p in live]
    assert len(set(ids)) == 50
    assert min(ids) >= 1  # slot 0 is the default pipeline's
    assert sorted(ids) == list(range(min(ids), min(ids) + 50))


def test_slots_are_per_worker_thread_and_priority() -> None:
    a0 = tp.Pipeline(0)
    a1 = tp.Pipeline(1)
    hi = tp.Pipeline(0, priority=-1)
    assert a0.id == a1.id == hi.id == 1
    assert (a0.worker_thread.id, a1.worker_thread.id) == (0, 1)
    assert hi.priority == -1 and a0.priority == 0
    b0 = tp.Pipeline(0)
    assert b0.id == 2


def test_priority_outside_the_range_is_refused_naming_it() -> None:
    """Without an accelerator the range is fixed, -3..0 (the levels of torch's CUDA pools)."""
    assert tp.Pipeline(priority=-3).priority == -3
    for bad in (-4, 1):
        with pytest.raises(ValueError, match=r"priority .* outside the range .*: 0 \(lowest, the "
                                             r"default\) to -3 \(highest\)"):
            tp.Pipeline(priority=bad)


def test_sim_lane_of_high_priority_has_a_high_priority_stream() -> None:
    """On the sim device (its own range, -3..0) a pipeline's streams take its priority."""
    import subprocess
    import sys

    code = (
        "import torch_pipeline as tp, torch_pipeline.sim as sim\n"
        "sim.enable(1)\n"
        "hi, lo = tp.Pipeline(priority=-3), tp.Pipeline()\n"
        "assert sim._C._sim_stream_priority(hi.stream('sim:0')) == -3\n"
        "assert sim._C._sim_stream_priority(lo.stream('sim:0')) == 0\n"
        "try:\n"
        "    tp.Pipeline(priority=-4)\n"
        "except ValueError as e:\n"
        "    assert 'the sim device' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('priority -4 accepted')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_pipeline_contexts_are_named_ranges_in_profiles() -> None:
    """torch.profiler shows each pipeline context as a range around the ops it ran."""
    from torch.profiler import ProfilerActivity, profile

    p = tp.Pipeline(1)
    x = torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with tp.pipeline(p):
            torch.add(x, 1)
    events = {e.name: e for e in prof.events()}
    name = f"tp.pipeline worker 1 slot {p.id}"
    assert name in events
    rng, op = events[name], events["aten::add"]
    assert rng.time_range.start <= op.time_range.start <= op.time_range.end <= rng.time_range.end


def test_tasks_are_named_ranges_with_their_ops_in_the_submitters_profile() -> None:
    """A task submitted while torch.profiler runs on the submitting thread is recorded there: a
    range "tp.task <qualname>() of pipeline ..." around its body, with its ops, on its worker thread. A
    task queued then but run after the profiler stopped still runs normally."""
    from torch.profiler import ProfilerActivity, profile

    p = tp.Pipeline(1)
    x = torch.ones(4)

    def work(t: torch.Tensor) -> torch.Tensor:
        return torch.mul(t, 2)

    gate = threading.Event()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        p.submit(work, x).wait()
        blocker = p.submit(gate.wait, TIMEOUT)
        late = p.submit(work, x)
    events = {e.name: e for e in prof.events()}
    name = f"work() of pipeline id={p.id} (priority 0)"
    task = next(e for n, e in events.items() if n.startswith("tp.task ") and n.endswith(name))
    mul = events["aten::mul"]
    assert task.time_range.start <= mul.time_range.start <= mul.time_range.end <= \
        task.time_range.end
    gate.set()
    blocker.wait()
    assert torch.equal(late.wait(), x * 2)


def test_temporary_pipeline_in_open_context_stays_alive() -> None:
    with tp.pipeline(tp.Pipeline()) as p:
        held = p.id
        del p
        gc.collect()
        other = tp.Pipeline()
        assert other.id != held, "the slot of the pipeline in the open context was reused"
        assert tp.current_pipeline().id == held
    del other
    gc.collect()
    assert tp.Pipeline().id == held  # released once the context closed


def test_pending_task_keeps_pipeline_alive() -> None:
    gate = threading.Event()
    p = tp.Pipeline(2)
    held = p.id
    fut = p.submit(gate.wait, TIMEOUT)
    del p
    gc.collect()
    q = tp.Pipeline(2)
    assert q.id != held, "a pipeline with a queued task lost its slot"
    gate.set()
    assert fut.wait() is True
    del q, fut
    gc.collect()
    wait_for(lambda: tp.Pipeline(2).id == held)


def test_eight_threads_creating_pipelines_concurrently_never_share_a_slot() -> None:
    barrier = threading.Barrier(8)
    live: list[list[tp.Pipeline]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            for round_ in range(200):
                p = tp.Pipeline(3)
                with p:
                    assert tp.current_pipeline() is p
                if round_ % 10 == 0:
                    live[i].append(p)  # keep some alive while the others churn
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    kept = [p for group in live for p in group]
    assert len(kept) == 160
    assert len({p.id for p in kept}) == 160, "two live pipelines share a slot"
    del kept, live
    gc.collect()
    assert tp.Pipeline(3).id == 1  # every slot came back


# ---- worker threads --------------------------------------------------------------------------
def test_worker_thread_handles() -> None:
    assert tp.max_worker_threads() == 4
    t = tp.get_worker_thread(2)
    assert t.id == 2 and t == tp.get_worker_thread(2) and t != tp.get_worker_thread(1)
    assert hash(t) == hash(tp.get_worker_thread(2))
    assert "id=2" in repr(t)
    assert tp.Pipeline(t).worker_thread == t
    assert tp.Pipeline(worker_thread=2).worker_thread.id == 2
    assert tp.Pipeline().worker_thread.id == 0
    with pytest.raises(ValueError, match="cap is 4"):
        tp.get_worker_thread(4)


def test_task_runs_on_its_worker_thread_with_its_pipeline_current() -> None:
    p = tp.Pipeline(1)
    main_ident = threading.get_ident()
    ident, current = p.submit(lambda: (threading.get_ident(), tp.current_pipeline())).wait()
    assert ident != main_ident
    assert current is p
    # Every pipeline of worker thread 1 runs its tasks on the same thread.
    assert tp.Pipeline(1).submit(threading.get_ident).wait() == ident
    assert tp.Pipeline(2).submit(threading.get_ident).wait() != ident
    assert tp.current_pipeline() == tp.default_pipeline()


def test_default_pipeline_tasks_run_on_worker_thread_zero() -> None:
    d = tp.default_pipeline()
    assert d.id == 0 and d.worker_thread.id == 0 and d.is_default
    assert tp.current_pipeline() is d or tp.current_pipeline() == d
    ident0 = tp.Pipeline(0).submit(threading.get_ident).wait()
    assert d.submit(threading.get_ident).wait() == ident0


def test_tasks_of_one_worker_thread_run_in_fifo_order() -> None:
    order: list[int] = []
    pipelines = [tp.Pipeline(1) for _ in range(3)]
    futs = [pipelines[i % 3].submit(order.append, i) for i in range(2000)]
    for f in futs:
        f.wait()
    assert order == list(range(2000))


def test_fifo_per_producer_with_many_producer_threads() -> None:
    p = tp.Pipeline(2)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(producer: int, i: int) -> None:
        with lock:
            seen.append((producer, i))

    def produce(producer: int) -> list[Any]:
        return [p.submit(record, producer, i) for i in range(300)]

    results: list[list[Any]] = [[] for _ in range(6)]
    threads = [
        threading.Thread(target=lambda k=k: results.__setitem__(k, produce(k))) for k in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for futs in results:
        for f in futs:
            f.wait()
    assert len(seen) == 1800
    for producer in range(6):
        assert [i for (q, i) in seen if q == producer] == list(range(300))


def test_pipelines_on_different_worker_threads_run_concurrently() -> None:
    barrier = threading.Barrier(3, timeout=TIMEOUT)
    futs = [tp.Pipeline(w).submit(barrier.wait) for w in (1, 2, 3)]
    # Only possible if the three tasks run at the same time.
    assert sorted(f.wait() for f in futs) == [0, 1, 2]


def test_thread_local_state_persists_across_tasks_of_a_worker() -> None:
    local = threading.local()
    p = tp.Pipeline(1)

    def bump() -> int:
        local.n = getattr(local, "n", 0) + 1
        return local.n

    values = [p.submit(bump).wait() for _ in range(5)]
    assert values == [values[0] + i for i in range(5)]


# ---- futures ---------------------------------------------------------------------------------
def test_submit_returns_a_torch_future_with_the_result() -> None:
    p = tp.Pipeline(1)
    fut = p.submit(torch.add, torch.ones(3), torch.full((3,), 2.0), alpha=2)
    assert isinstance(fut, torch.futures.Future)
    assert torch.equal(fut.wait(), torch.full((3,), 5.0))
    assert fut.done()
    assert torch.equal(fut.value(), torch.full((3,), 5.0))


def test_submit_passes_an_fn_keyword_to_the_task() -> None:
    def f(*, fn: int) -> int:
        return fn * 2

    assert tp.Pipeline(1).submit(f, fn=21).wait() == 42


def test_exception_in_task_is_raised_by_wait() -> None:
    class Boom(Exception):
        pass

    def fail() -> None:
        raise Boom("task failed on purpose")

    fut = tp.Pipeline(1).submit(fail)
    with pytest.raises(Boom, match="on purpose"):
        fut.wait()
    # The worker goes on with the next task.
    assert tp.Pipeline(1).submit(lambda: 7).wait() == 7


def test_a_task_may_return_values_that_cannot_be_pickled() -> None:
    p = tp.Pipeline(1)
    assert list(p.submit(lambda: (i for i in range(3))).wait()) == [0, 1, 2]
    assert p.submit(lambda: p).wait() is p
    assert p.submit(lambda: (lambda: 5)).wait()() == 5


def test_warnings_are_python_warnings() -> None:
    """torch_pipeline warns through one function (csrc/runtime/warn.h), and its warnings are
    Python warnings, also those raised on a worker thread: here a task completes its own future,
    so completing it with the task's return value fails, which can only be warned about."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    def task() -> str:
        ready.wait(TIMEOUT)
        box["future"].set_exception(ValueError("completed by the task itself"))
        return "second"

    with pytest.warns(UserWarning, match="torch_pipeline: could not complete a task's future"):
        fut = tp.Pipeline(1).submit(task)
        box["future"] = fut
        ready.set()
        with pytest.raises(ValueError, match="completed by the task itself"):
            fut.wait()


def test_future_then_and_wait_all() -> None:
    p = tp.Pipeline(1)
    futs = [p.submit(lambda i=i: i * i) for i in range(10)]
    chained = futs[3].then(lambda f: f.value() + 1)
    assert torch.futures.wait_all(futs) == [i * i for i in range(10)]
    assert chained.wait() == 10


def test_task_may_submit_more_tasks() -> None:
    p = tp.Pipeline(1)
    q = tp.Pipeline(2)
    outer = p.submit(lambda: q.submit(lambda: "inner"))
    assert outer.wait().wait() == "inner"


def test_pipeline_synchronize_and_query_cover_queued_tasks() -> None:
    gate = threading.Event()
    done: list[int] = []
    p = tp.Pipeline(1)
    p.submit(gate.wait, TIMEOUT)
    p.submit(done.append, 1)
    assert p.query() is False
    threading.Timer(0.05, gate.set).start()
    p.synchronize()
    assert done == [1]
    assert p.query() is True


def test_global_synchronize_waits_for_every_worker_thread() -> None:
    done: list[int] = []
    for w in (1, 2, 3):
        tp.Pipeline(w).submit(lambda w=w: (time.sleep(0.05), done.append(w)))
    tp.synchronize()
    assert sorted(done) == [1, 2, 3]


def test_global_synchronize_inside_a_task_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="cannot be called from a task"):
        tp.Pipeline(1).submit(tp.synchronize).wait()


def test_pipeline_synchronize_inside_its_own_task_does_not_deadlock() -> None:
    p = tp.Pipeline(1)
    assert p.submit(lambda: (p.synchronize(), "ok")[1]).wait() == "ok"


# ---- the current pipeline --------------------------------------------------------------------
def test_context_sets_and_restores_the_current_pipeline() -> None:
    p, q = tp.Pipeline(), tp.Pipeline()
    assert tp.current_pipeline() == tp.default_pipeline()
    with tp.pipeline(p) as entered:
        assert entered is p and tp.current_pipeline() is p
        with q:
            assert tp.current_pipeline() is q
            with tp.pipeline(p):  # the same pipeline twice: each entry has its own state
                assert tp.current_pipeline() is p
            assert tp.current_pipeline() is q
        assert tp.current_pipeline() is p
    assert tp.current_pipeline() == tp.default_pipeline()


def test_context_restores_on_exception() -> None:
    p = tp.Pipeline()
    with pytest.raises(KeyError):
        with tp.pipeline(p):
            with tp.pipeline(tp.Pipeline()):
                raise KeyError("inner")
    assert tp.current_pipeline() == tp.default_pipeline()


def test_pipeline_none_is_a_no_op() -> None:
    p = tp.Pipeline()
    with p:
        with tp.pipeline(None) as entered:
            assert entered is None
            assert tp.current_pipeline() is p
        assert tp.current_pipeline() is p


def test_one_context_object_can_be_reused_and_nested() -> None:
    p = tp.Pipeline()
    ctx = tp.pipeline(p)
    with ctx:
        with ctx:
            assert tp.current_pipeline() is p
        assert tp.current_pipeline() is p
    with ctx:
        assert tp.current_pipeline() is p
    assert tp.current_pipeline() == tp.default_pipeline()


def test_current_pipeline_is_thread_local() -> None:
    p = tp.Pipeline()
    seen: list[Any] = []
    entered = threading.Event()
    checked = threading.Event()

    def other() -> None:
        entered.wait(TIMEOUT)
        seen.append(tp.current_pipeline())
        q = tp.Pipeline()
        with q:
            seen.append(tp.current_pipeline() is q)
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with p:
        entered.set()
        checked.wait(TIMEOUT)
        assert tp.current_pipeline() is p
    t.join(TIMEOUT)
    assert seen[0] == tp.default_pipeline()
    assert seen[1] is True


def test_set_pipeline_inside_a_context_is_undone_by_its_exit() -> None:
    p, q = tp.Pipeline(), tp.Pipeline()
    with p:
        tp.set_pipeline(q)
        assert tp.current_pipeline() is q
    assert tp.current_pipeline() == tp.default_pipeline()
    tp.set_pipeline(q)
    try:
        assert tp.current_pipeline() is q
        tp.set_pipeline(None)  # like torch.cuda.set_stream(None): no change
        assert tp.current_pipeline() is q
    finally:
        tp.set_pipeline(tp.default_pipeline())
    assert tp.current_pipeline() == tp.default_pipeline()


def test_exiting_out_of_order_is_an_error_and_leaves_state_intact() -> None:
    p, q = tp.Pipeline(), tp.Pipeline()
    p.__enter__()
    q.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        p.__exit__(None, None, None)
    assert tp.current_pipeline() is q
    q.__exit__(None, None, None)
    p.__exit__(None, None, None)
    assert tp.current_pipeline() == tp.default_pipeline()


# ---- decorators ------------------------------------------------------------------------------
def test_pipeline_as_decorator() -> None:
    p = tp.Pipeline()

    @tp.pipeline(p)
    def f(x: int) -> tuple[Any, int]:
        return tp.current_pipeline(), x + 1

    assert f(1) == (p, 2)
    assert f.__name__ == "f"
    assert tp.current_pipeline() == tp.default_pipeline()


def test_pipelined_with_an_explicit_pipeline() -> None:
    p = tp.Pipeline()

    @tp.pipelined(p)
    def f() -> Any:
        return tp.current_pipeline()

    assert f() is p


def test_pipelined_module_forward_uses_self_pipeline() -> None:
    class Branch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pipeline = tp.Pipeline()
            self.lin = torch.nn.Linear(4, 4)
            self.seen: Any = None

        @tp.pipelined
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = tp.current_pipeline()
            return self.lin(x)

    m = Branch()
    y = m(torch.ones(2, 4))
    assert y.shape == (2, 4)
    assert m.seen is m.pipeline
    assert tp.current_pipeline() == tp.default_pipeline()


def test_pipelined_generator_runs_each_step_under_the_pipeline() -> None:
    p = tp.Pipeline()

    @tp.pipeline(p)
    def gen() -> Iterator[Any]:
        for _ in range(3):
            yield tp.current_pipeline()

    it = gen()
    for value in it:
        assert value is p
        assert tp.current_pipeline() == tp.default_pipeline()  # not leaked between steps


# ---- identity and events ---------------------------------------------------------------------
def test_pipeline_eq_hash_repr() -> None:
    p, q = tp.Pipeline(), tp.Pipeline()
    assert p == p and p != q and hash(p) != hash(q)
    assert {p: 1}[p] == 1
    assert f"id={p.id}" in repr(p) and "worker_thread=0" in repr(p)
    with p:
        assert tp.current_pipeline() == p and hash(tp.current_pipeline()) == hash(p)
    assert "default" in repr(tp.default_pipeline())


def test_streams_and_events_on_a_machine_without_accelerator() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    p = tp.Pipeline()
    assert p.stream() is None and p.stream("cpu") is None
    ev = p.record_event()
    assert isinstance(ev, tp.PipelineEvent)
    assert ev.devices == [] and ev.query() is True
    ev.synchronize()
    p.wait_event(ev)
    p.wait_pipeline(tp.Pipeline())
    assert p.record_event(ev) is ev


def test_oneflow_pipeline_is_an_alias() -> None:
    assert oneflow_pipeline.Pipeline is tp.Pipeline
    assert oneflow_pipeline.pipeline is tp.pipeline
    assert set(oneflow_pipeline.__all__) == set(tp.__all__)
    p = oneflow_pipeline.Pipeline()
    with oneflow_pipeline.pipeline(p):
        assert tp.current_pipeline() is p
    assert oneflow_pipeline.track is tp.track and oneflow_pipeline.collective is tp.collective
    assert oneflow_pipeline.distributed.thread_groups is tp.distributed.thread_groups
