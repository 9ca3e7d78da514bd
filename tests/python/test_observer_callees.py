"""The callees of an observed op (docs/design.md §4, the tracker's rooms: observer): their
RecordFunction events are ignored by the tracker, so for an operator seen calling many, the observer
switches RecordFunction off on its thread for the op's duration. Only while the tracker's callback
is the only one (a profiler still sees every op), and on again after the op, also when it raises.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

from typing import Callable, Set

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim


_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=1)


def conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x, w, padding=1)  # conv2d calls convolution, _convolution ...


def profiled(fn: Callable[[], object]) -> Set[str]:
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events}


def test_a_profiler_sees_the_callees_of_observed_ops() -> None:
    x = torch.randn(1, 3, 8, 8, device="sim:0")
    w = torch.randn(4, 3, 3, 3, device="sim:0")
    p = tp.Pipeline()
    with p:
        for _ in range(3):
            conv(x, w)  # the observer learns that conv2d has many callees
        names = profiled(lambda: conv(x, w))
    tp.synchronize()
    del p
    assert "aten::conv2d" in names
    assert "aten::convolution" in names, sorted(names)


def test_ops_after_an_observed_op_that_raised_are_tracked() -> None:
    x = torch.randn(1, 3, 8, 8, device="sim:0")
    w = torch.randn(4, 3, 3, 3, device="sim:0")
    bad = torch.randn(4, 5, 3, 3, device="sim:0")  # 5 input channels: conv2d raises inside
    p = tp.Pipeline()
    with p:
        for _ in range(3):
            conv(x, w)
        with pytest.raises(RuntimeError):
            conv(x, bad)
    # Still observed after the error: otherwise the read on p's stream below is not ordered after
    # the write on the default stream, and strict sim raises a RaceError.
    for _ in range(3):
        y = x * 2
        with p:
            z = torch.sin(y)
        z.sum().item()
    tp.synchronize()
    del p
    assert not sim.races()


install_proxies(globals(), __file__)
