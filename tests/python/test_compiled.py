"""Compiled regions (torch.compile) under pipelines: each call of AOTAutograd's compiled forward,
backward or inference function is tracked as one op (torch_pipeline/_compiled.py).

On the sim device a test backend stands in for Triton: its kernels run with RecordFunction off,
so the tracker cannot see them (as it cannot see Triton launches), while the sim race checker
still does. Tracked as regions, compiled programs are race-free and bit-equal to eager; with the
region wrap switched off they race, and the region in which nothing was tracked is counted and
warned about. On the CPU the real Inductor (C++ kernels) runs inside pipelines.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch
import torch.nn as nn

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch_pipeline import _C, _compiled

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


def hidden_backend() -> Any:
    """An AOTAutograd backend whose kernels the tracker never sees (like Triton's)."""
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm: Any, example_inputs: Any) -> Callable[[List[Any]], Any]:
        def run(args: List[Any]) -> Any:
            _C._set_record_function_enabled(False)
            try:
                return gm(*args)
            finally:
                _C._set_record_function_enabled(True)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _model(device: str) -> "nn.Module":
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)


def _steps(model: "nn.Module", fn: Callable[..., Any], p: Any, steps: int = 3
           ) -> List[torch.Tensor]:
    """Training steps: the input is made on the default stream, forward and backward run in p,
    the loss and the gradients are read back on the default stream."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    for i in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(i)).to("sim:0") * 2
        with tp.pipeline(p):
            loss = fn(x).square().mean()
            loss.backward()
        got.append(loss.detach() + 0)
        got += [q.grad + 0 for q in model.parameters()]
        opt.step()
        opt.zero_grad()
    return [t.cpu() for t in got]


@contextlib.contextmanager
def regions_unwrapped() -> Iterator[None]:
    _compiled._enabled = False
    _C._set_regions_wrapped(False)
    try:
        yield
    finally:
        _compiled._enabled = True
        _C._set_regions_wrapped(True)


def test_compiled_regions_are_tracked_as_ops() -> None:
    torch._dynamo.reset()
    reference = _model("sim:0")
    eager = _steps(reference, reference, None)
    model = _model("sim:0")
    before = tp.tracking_stats()["compiled_regions"]
    got = _steps(model, torch.compile(model, backend=hidden_backend()), tp.Pipeline())
    assert sim.races() == []
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    assert tp.tracking_stats()["compiled_regions"] - before >= 6  # forward and backward, 3 steps


def test_untracked_compiled_regions_race_and_are_reported() -> None:
    torch._dynamo.reset()
    model = _model("sim:0")
    compiled = torch.compile(model, backend=hidden_backend())
    _steps(model, compiled, tp.Pipeline(), steps=1)  # compiled once, tracked
    before = tp.tracking_stats()["compiled_unwrapped"]
    sim.set_strict(False)
    with regions_unwrapped(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(model, compiled, tp.Pipeline(), steps=1)
        assert sim.races(), "the hidden kernels did not race without region tracking"
    assert tp.tracking_stats()["compiled_unwrapped"] > before


def test_ops_inside_a_region_are_not_tracked_again() -> None:
    torch._dynamo.reset()
    model = _model("sim:0")
    compiled = torch.compile(model, backend="aot_eager")  # its kernels are dispatcher ops
    x = torch.randn(16, 32).to("sim:0")
    p = tp.Pipeline()
    with tp.pipeline(p):
        compiled(x)
        s0 = tp.tracking_stats()
        out = compiled(x)
        s1 = tp.tracking_stats()
    assert s1["compiled_regions"] - s0["compiled_regions"] == 1
    assert s1["ops"] - s0["ops"] <= 1  # (the region is one launch, not the graph's ops)
    assert torch.equal(out.cpu(), model(x).cpu())
    assert sim.races() == []


def test_a_region_that_raises_ends() -> None:
    """An error inside a compiled region closes it: ops after it are observed again."""
    torch._dynamo.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._check(y.shape[0] == 3, lambda: "bad batch")
        return y + 1

    compiled = torch.compile(f, backend="aot_eager")
    p = tp.Pipeline()
    compiled(torch.ones(3).to("sim:0"))
    with tp.pipeline(p):
        with pytest.raises(Exception):
            compiled(torch.ones(5).to("sim:0"))
        ops = tp.tracking_stats()["ops"]
        torch.ones(2).to("sim:0") + 1
    assert tp.tracking_stats()["ops"] > ops


def test_a_compiled_function_that_switches_streams_inside_stays_correct() -> None:
    """A user stream inside compiled code (a torch.Stream context in the function), called in a
    pipeline: the right values, race-free in strict mode."""
    torch._dynamo.reset()
    side = torch.Stream(device="sim:0")

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with side:
            z = y + 1
        return z * 3

    compiled = torch.compile(f, backend="aot_eager")
    x = torch.arange(4096.0).to("sim:0")
    p = tp.Pipeline()
    with tp.pipeline(p):
        out = compiled(x)
        again = compiled(x * 1)
    want = (torch.arange(4096.0) * 2 + 1) * 3
    assert torch.equal(out.cpu(), want) and torch.equal(again.cpu(), want)
    assert sim.races() == []


@pytest.mark.compiler
def test_inductor_on_the_cpu_inside_pipelines_equals_eager() -> None:
    """The real Inductor (C++ kernels): results equal eager's (up to Inductor's fusion)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    ref = model(x)
    ref.sum().backward()
    grads = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model)
    before = tp.tracking_stats()["compiled_regions"]
    with tp.pipeline(tp.Pipeline()):
        out = compiled(x)
        out.sum().backward()
    assert torch.allclose(out, ref, atol=1e-5)
    assert all(torch.allclose(q.grad, g, atol=1e-5) for q, g in zip(model.parameters(), grads))
    assert tp.tracking_stats()["compiled_regions"] - before == 2


# Run as a fresh process: whether torch._dynamo is imported yet is what this checks.
_RANGE_CHECK_CHILD = textwrap.dedent("""
    import sys, torch, torch_pipeline as tp, torch_pipeline.sim as sim
    from torch_pipeline import _C
    sim.enable(num_devices=1)
    assert "torch._dynamo" not in sys.modules, "the test needs a process without torch._dynamo"
    p = tp.Pipeline()
    states = [_C._range_check_installed()]
    import torch._dynamo
    states.append(_C._range_check_installed())
    _C._set_regions_wrapped(False)
    states.append(_C._range_check_installed())
    del p
    states.append(_C._range_check_installed())
    print(*states)
""")


def test_the_range_check_is_installed_only_while_an_unwrapped_region_can_run() -> None:
    """Without torch._dynamo no compiled region can run, and with regions wrapped each is tracked:
    the check of Dynamo's ranges (a RecordFunction callback every op would pay) stays out; it goes
    in when regions are unwrapped, and out again when tracking goes idle."""
    env = dict(os.environ, TORCH_PIPELINE_OBSERVER="dispatcher")
    env.pop("TORCH_PIPELINE_SIM_TEST_CHILD", None)
    r = subprocess.run([sys.executable, "-c", _RANGE_CHECK_CHILD], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "True", "False"]


install_proxies(globals(), __file__)
