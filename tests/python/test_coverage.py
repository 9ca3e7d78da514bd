"""What automatic synchronization covers, and that what it cannot cover is loud (sim, strict).

* A pipeline is a lane over every device it touches: the first op a pipeline context runs on a
  device makes the pipeline's stream there current for the rest of the context (restored on exit,
  also on error), so two pipelines' work on a second device does not serialize on its default
  stream.
* The outermost op *that touches real storage* is tracked: under torch.func transforms and
  __torch_dispatch__ wrapper subclasses the outermost op sees tensors without storage, and the ops
  it calls are tracked instead (test_workloads.py has the races this removes).
* No silent gaps: an op on a device whose accesses cannot be accounted for is warned about once
  per operator, with what to do (tp.track), and listed by tp.tracking_stats().

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import warnings
from typing import Any, List

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch.utils._pytree import tree_map

N = 1024


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def current(index: int) -> "torch.Stream":
    return torch.accelerator.current_stream(index)


_defaults: List[Any] = []  # each sim device's stream outside any pipeline context


def _remember_defaults() -> None:
    if not _defaults:
        _defaults.extend([current(0), current(1)])


# ---- every device a pipeline touches ---------------------------------------------------------------
def test_the_first_op_on_a_device_makes_the_pipelines_stream_current_there() -> None:
    _remember_defaults()
    pa, pb = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(N, device="sim:0")
    with tp.pipeline(pa):
        assert current(1) == _defaults[1]          # nothing on sim:1 yet
        ya = x.to("sim:1") * 2                     # the copy runs on sim:1: pa's lane joins it
        sa = current(1)
    with tp.pipeline(pb):
        yb = x.to("sim:1") * 3
        sb = current(1)
    assert sa != _defaults[1] and sb != _defaults[1] and sa != sb
    assert sa == pa.stream("sim:1") and sb == pb.stream("sim:1")
    assert current(1) == _defaults[1], "leaving the context restores sim:1's stream"
    assert torch.equal((ya + yb).cpu(), torch.full((N,), 5.0))
    assert sim.races() == []


def test_a_factory_on_another_device_joins_the_lane() -> None:
    _remember_defaults()
    p = tp.Pipeline()
    with tp.pipeline(p):
        z = torch.full((N,), 2.0, device="sim:1")
        assert current(1) == p.stream("sim:1")
        z.mul_(3)
    assert current(1) == _defaults[1]
    assert torch.equal((z + 1).cpu(), torch.full((N,), 7.0))
    assert sim.races() == []


def test_the_device_stream_is_restored_when_the_body_raises() -> None:
    _remember_defaults()
    p = tp.Pipeline()
    x = torch.ones(N, device="sim:0")
    with pytest.raises(ValueError):
        with tp.pipeline(p):
            y = x.to("sim:1")
            assert current(1) == p.stream("sim:1")
            raise ValueError("body failed")
    assert current(1) == _defaults[1]
    assert current(0) == _defaults[0]
    assert torch.equal(y.cpu(), torch.ones(N))


def test_nested_contexts_each_join_their_own_pipeline() -> None:
    _remember_defaults()
    pa, pb = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(N, device="sim:1")
    with tp.pipeline(pa):
        outer = current(1)                         # pa's, if its slot had a sim:1 stream already
        with tp.pipeline(pb):
            y = x * 2
            assert current(1) == pb.stream("sim:1")
        assert current(1) == outer                 # pb's entry switched it, pb's exit restored it
        z = y + x
        assert current(1) == pa.stream("sim:1")
    assert current(1) == _defaults[1]
    assert torch.equal(z.cpu(), torch.full((N,), 3.0))
    assert sim.races() == []


# ---- no silent gaps ---------------------------------------------------------------------------------
if IN_CHILD:
    class RawKernelTensor(torch.Tensor):
        """A wrapper subclass whose ops run as raw kernels the dispatcher never sees (as a
        hand-written extension launching on data pointers would)."""

        elem: torch.Tensor

        @staticmethod
        def __new__(cls, elem: torch.Tensor) -> "RawKernelTensor":
            r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), dtype=elem.dtype,
                                                    device=elem.device)
            r.elem = elem
            return r

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten.mul_.Tensor:
                target = args[0].elem
                sim.raw_kernel("raw_mul", read=[target], write=[target])
                return args[0]
            unwrap = lambda t: t.elem if isinstance(t, RawKernelTensor) else t  # noqa: E731
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(lambda t: RawKernelTensor(t) if isinstance(t, torch.Tensor) else t, out)


def test_an_op_whose_memory_the_tracker_cannot_see_is_warned_about_once() -> None:
    p = tp.Pipeline()
    sim.set_strict(False)
    x = RawKernelTensor(torch.ones(N, device="sim:0"))
    with pytest.warns(UserWarning, match=r"cannot see the memory that aten::mul_\.Tensor touches"):
        with tp.pipeline(p):
            x.mul_(x)
    stats = tp.tracking_stats()
    assert "aten::mul_.Tensor" in stats["gap_ops"] and stats["gaps"] >= 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tp.pipeline(p):
            x.mul_(x)                              # the same operator again: counted, not warned
    assert not [w for w in seen if "cannot see the memory" in str(w.message)]
    assert tp.tracking_stats()["gaps"] > stats["gaps"]


def test_torch_func_and_wrapper_subclasses_are_not_gaps() -> None:
    p = tp.Pipeline()
    xs = torch.randn(4, 8).to("sim:0")
    before = tp.tracking_stats()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with tp.pipeline(p):
            torch.vmap(lambda r: torch.sin(r) * 2)(xs)
            torch.func.grad(lambda x: (x * x).sum())(xs[0])
            torch.func.jacrev(torch.sin)(xs[1])
            torch.func.jvp(torch.exp, (xs[2],), (torch.ones_like(xs[2]),))
    gaps = [str(w.message) for w in seen if "cannot see the memory" in str(w.message)]
    assert not gaps, gaps
    after = tp.tracking_stats()
    assert after["gaps"] == before["gaps"], after["gap_ops"]
    assert after["unclaimed"] > before["unclaimed"], "the transforms' outer ops were left to inner ones"
    assert sim.races() == []


def test_tracking_stats_reports_what_users_monitor() -> None:
    p = tp.Pipeline()
    x = torch.ones(N, device="sim:0")
    with tp.pipeline(p):
        y = x * 2                                   # x is used off its allocation stream: kept alive
    stats = tp.tracking_stats()
    for key in ("live", "ops", "waits", "storages", "kept_alive", "kept_alive_bytes", "gaps",
                "gap_ops", "unclaimed", "pin_waits", "host_waits"):
        assert key in stats
    assert stats["live"] and stats["ops"] > 0
    assert isinstance(stats["gap_ops"], list)
    del y


install_proxies(globals(), __file__)
