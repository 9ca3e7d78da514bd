"""What the ports of PyTorch's own device tests share (test_sim_ported_accelerator.py,
test_sim_ported_cuda.py; the list of what is ported and what cannot apply is
docs/sim_cuda_parity.md).

Every ported test runs twice, in the sim's synchronous and in its asynchronous mode (the ``mode``
fixture, parametrized by :func:`parametrize_modes` from the module's ``pytest_generate_tests``),
from the same state: device 0, the default streams current, the host synchronized with both
devices, no latency set, automatic synchronization (torch_pipeline's tracking) off so that the
sim behaves as a plain device, and no race recorded. A test also fails when the race checker
reported a race during it: PyTorch's tests are meant to be correctly synchronized programs (where
one is not, its port adds the missing wait and says so).

:func:`sleep_ms` stands in for ``torch.cuda._sleep(cycles)``, the spin kernel PyTorch's tests use
to keep a stream busy: a kernel on the current stream that takes that long on the device (in
asynchronous mode the stream's thread spends the time, the host goes on at once; in synchronous
mode the calling thread does, after the kernel, as every sim kernel).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Tuple

import pytest

from _sim_child import IN_CHILD

MODES = ("sync", "async")
# The ops whose kernels sleep_ms() makes slow (no ported test uses them otherwise): one per sleep
# running at once, since the modelled time is set per op (threads sleep at the same time).
_SLEEP_OPS = [("aten::sinh.out", "sinh_"), ("aten::cosh.out", "cosh_"),
              ("aten::tanh.out", "tanh_"), ("aten::asinh.out", "asinh_")]
_free_sleep_ops = list(_SLEEP_OPS)
_sleep_lock = threading.Lock()


def parametrize_modes(metafunc: Any) -> None:
    """Call from the module's ``pytest_generate_tests``: every test runs in both modes (in the
    child process; the parent's proxies stand for both)."""
    if IN_CHILD and "mode" in metafunc.fixturenames:
        metafunc.parametrize("mode", MODES, indirect=True)


def sleep_ms(ms: float) -> None:
    """A kernel on the current stream of the current device that takes ``ms`` milliseconds
    (``torch.cuda._sleep(int(ms * get_cycles_per_ms()))`` in PyTorch's tests)."""
    import torch
    import torch_pipeline.sim as sim

    busy = torch.zeros(1, device=f"sim:{torch.accelerator.current_device_index()}")
    with _sleep_lock:
        op, method = _free_sleep_ops.pop()
    try:
        sim.set_latency(op=op, us=ms * 1000.0)  # read when the kernel is queued
        try:
            getattr(busy, method)()
        finally:
            sim.set_latency(op=op, us=None)
    finally:
        with _sleep_lock:
            _free_sleep_ops.append((op, method))


def is_async() -> bool:
    import torch_pipeline.sim as sim

    return sim.is_asynchronous()


def _reset(num_devices: int) -> None:
    import torch
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

    _C._set_tracking_enabled(False)
    sim.set_strict(False)
    sim.clear_latency()
    for d in range(num_devices):
        torch.accelerator.set_stream(sim.default_stream(d))
    torch.accelerator.set_device_index(0)
    for d in range(num_devices):
        sim.synchronize(d)
    torch.accelerator.empty_cache()
    sim.clear_races()


def ported_fixtures(num_devices: int = 2, as_cuda: bool = False) -> Tuple[Any, Any]:
    """The module's fixtures (bind both names: ``_sim_module, mode = ported_fixtures(...)``):
    sim enabled with ``num_devices`` for the module (inside ``sim.as_cuda(devices=...)`` with
    ``as_cuda``: torch.cuda's names mapped to sim, as ``python -m torch_pipeline.sim run`` runs
    a CUDA program), and the per-test ``mode`` ("sync" or "async") with the state above. In the
    parent process they do nothing."""

    @pytest.fixture(scope="module", autouse=True)
    def _sim_module() -> Iterator[None]:
        if not IN_CHILD:
            yield
            return
        import torch_pipeline.sim as sim

        with contextlib.ExitStack() as stack:
            if as_cuda:
                stack.enter_context(sim.as_cuda(devices=num_devices))
            else:
                sim.enable(num_devices=num_devices)
            yield

    @pytest.fixture(autouse=True)
    def mode(request: Any) -> Iterator[str]:
        if not IN_CHILD:
            yield "parent"
            return
        import torch
        import torch_pipeline.sim as sim

        which = getattr(request, "param", "sync")
        _reset(num_devices)
        sim.set_asynchronous(which == "async")
        if which == "async":
            # An op is queued by a plan for its outputs that is checked against the CPU kernel
            # the first time (the op then runs at once, on the host): sleep_ms()'s kernels run
            # once here, so that their plans are checked before a test relies on them queued.
            for d in range(num_devices):
                for _, method in _SLEEP_OPS:
                    getattr(torch.zeros(1, device=f"sim:{d}"), method)()
                sim.synchronize(d)
        yield which
        for d in range(num_devices):
            sim.synchronize(d)
        races = sim.races()
        sim.set_asynchronous(False)
        _reset(num_devices)
        assert races == [], "the race checker reported races:\n" + "\n".join(map(str, races))

    return _sim_module, mode
