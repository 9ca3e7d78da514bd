"""What a task is given and what it returns, on the sim device in strict mode.

* Results: a task's future carries any Python value (a generator, a lambda, a Pipeline, tensors
  nested in containers), without pickling it; ``wait()`` still orders the waiter after the task's
  device work (strict sim raises on any unordered access).
* Arguments: the tensors passed to ``submit`` are pinned at any depth of lists, tuples
  (namedtuples), dicts (keys and values), sets and dataclasses, cycles included: a checkpoint saver submitted
  ``opt.state_dict()`` (Adam's ``state[i]["exp_avg"]`` lies four containers down) while the main
  thread keeps training saves the values of the moment of submission.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable, Dict, List

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch.utils import _pytree as pytree

N = 1024
SLOW_S = 0.3  # how long a task sleeps before it reads its arguments: the submitter runs ahead


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


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


# ---- arguments pinned at any depth ---------------------------------------------------------------
def _snapshot(tree: Any) -> Any:
    """A deep copy on the CPU (state dicts hold tensors and plain values)."""
    return pytree.tree_map(
        lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, tree)


def _assert_equal_trees(got: Any, expected: Any) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    assert got_spec == exp_spec
    for g, e in zip(got_leaves, exp_leaves):
        if isinstance(e, torch.Tensor):
            assert torch.equal(g, e), "the task saw a later value than the one it was given"
        else:
            assert g == e


def _saves_while_training(make_payload: Callable[[torch.nn.Module, torch.optim.Optimizer], Any],
                          saves: int = 2, steps_between: int = 3) -> None:
    """A saver pipeline on worker thread 1 saves `make_payload(model, opt)` while the main thread
    keeps training; what it saves equals a deep copy taken at submission."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("sim:0")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(16, 32, device="sim:0")
    y = torch.randn(16, 4, device="sim:0")

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    step()
    saver = tp.Pipeline(tp.get_worker_thread(1))
    saved: List[Any] = []

    def save(payload: Any) -> None:
        time.sleep(SLOW_S)  # the main thread trains on meanwhile
        saved.append(_snapshot(payload))

    expected = []
    futures = []
    for _ in range(saves):
        payload = make_payload(model, opt)
        expected.append(_snapshot(payload))
        futures.append(saver.submit(save, payload))
        for _ in range(steps_between):
            step()
    for f in futures:
        f.wait()
    assert len(saved) == saves
    for got, exp in zip(saved, expected):
        _assert_equal_trees(got, exp)
    assert sim.races() == []


def test_saving_the_optimizer_state_dict_while_training() -> None:
    _saves_while_training(lambda model, opt: opt.state_dict())


def test_saving_model_and_optimizer_state_dicts_while_training() -> None:
    _saves_while_training(
        lambda model, opt: {"model": model.state_dict(), "optim": opt.state_dict()})


Pair = collections.namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Batch:
    inputs: Any
    step: int = 0


@dataclasses.dataclass
class DictOutput(collections.OrderedDict):  # type: ignore[type-arg]
    """Like Hugging Face's ModelOutput: a dataclass that is a dict, whose fields set after it was
    made are not among its items."""
    loss: Any = None


def _dict_output(x: "torch.Tensor") -> DictOutput:
    out = DictOutput()
    out.loss = x
    return out


def _seen_by_a_slow_task(wrap: Callable[["torch.Tensor"], Any],
                         unwrap: Callable[[Any], "torch.Tensor"]) -> float:
    x = torch.ones(N, device="sim:0")
    started = threading.Event()

    def task(arg: Any) -> float:
        started.set()
        time.sleep(SLOW_S)
        return unwrap(arg).sum().item()

    fut = tp.Pipeline(tp.get_worker_thread(1)).submit(task, wrap(x))
    started.wait(5)
    x.fill_(100.0)  # the submitter's later in-place write waits for the task
    return fut.wait()


def _cycle(x: "torch.Tensor") -> List[Any]:
    a: List[Any] = [x]
    a.append(a)
    return a


@pytest.mark.parametrize("wrap, unwrap", [
    (lambda x: [[[[[x]]]]], lambda a: a[0][0][0][0][0]),
    (lambda x: Pair(1, Pair(2, {"deep": (x,)})), lambda a: a.second.second["deep"][0]),
    (lambda x: {(0, 1): {x: "as a key"}}, lambda a: next(iter(a[(0, 1)]))),
    (lambda x: {"set": {x}}, lambda a: next(iter(a["set"]))),
    (_cycle, lambda a: a[1][1][1][0]),
    (lambda x: torch.nn.Parameter(x, requires_grad=False), lambda a: a),
    (lambda x: Batch(Batch([x], 1)), lambda a: a.inputs.inputs[0]),
    (_dict_output, lambda a: a.loss),
], ids=["lists", "namedtuples", "dict-keys", "sets", "cycle", "tensor-subclass", "dataclasses",
        "dict-dataclass"])
def test_tensors_at_any_depth_are_pinned(wrap: Any, unwrap: Any) -> None:
    assert _seen_by_a_slow_task(wrap, unwrap) == float(N)
    assert sim.races() == []


def test_a_very_deep_argument_does_not_hit_the_recursion_limit() -> None:
    x = torch.ones(N, device="sim:0")
    deep: Any = x
    for _ in range(20000):
        deep = [deep]
    fut = tp.Pipeline(tp.get_worker_thread(1)).submit(lambda d: 7, deep)
    assert fut.wait() == 7


# A task that hands its argument to a task it submits and waits for it: the writes of that task are
# the first task's own work and must not wait for its pins (they waited forever: the first task
# waited for the second, the second's write for the first's end). Run in a process of its own, so
# that a hang fails the test instead of the process.
NESTED_WRITER = textwrap.dedent("""
    import torch, torch_pipeline as tp, torch_pipeline.sim as sim
    sim.enable(num_devices=1, strict=True)
    outer, inner = tp.Pipeline(tp.get_worker_thread(1)), tp.Pipeline(tp.get_worker_thread(2))
    last = tp.Pipeline(tp.get_worker_thread(3))

    def fill(t):
        t.add_(1)                                   # writes what the outer task pinned
        return t.sum().item()

    def delegate(t):
        return inner.submit(fill, t).wait()         # waits for the task it submitted

    def delegate_by_closure(t):
        return inner.submit(lambda: fill(t)).wait() # (the inner task pins nothing itself)

    def delegate_twice(t):
        return inner.submit(lambda: last.submit(fill, t).wait()).wait()

    x = torch.zeros(16, device="sim:0")
    print(outer.submit(delegate, x).wait(), outer.submit(delegate_by_closure, x).wait(),
          outer.submit(delegate_twice, x).wait(), flush=True)
    assert sim.races() == []
""")


def test_tasks_a_task_submits_may_write_its_arguments() -> None:
    proc = subprocess.run([sys.executable, "-c", NESTED_WRITER], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["16.0", "32.0", "48.0"], proc.stdout


install_proxies(globals(), __file__)
