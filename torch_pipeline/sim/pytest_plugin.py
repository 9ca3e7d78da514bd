"""A pytest plugin that runs a CUDA test suite on sim devices and fails every test that races.

    pytest -p torch_pipeline.sim.pytest_plugin --sim-cuda tests/

With ``--sim-cuda`` the whole session runs under :func:`torch_pipeline.sim.as_cuda` (``"cuda"`` is
a sim device, ``torch.cuda.is_available()`` is True), and a test whose ops raced fails with the
race report: the Python lines of both accesses, the tensor, the streams, the fix. Options:
``--sim-devices N`` (default 2), ``--sim-async`` (asynchronous mode: a missing wait also gives
wrong values). Without ``--sim-cuda`` the plugin does nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Generator, Optional

import pytest

_session: Optional[contextlib.ExitStack] = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torch_pipeline.sim", "race-checking CUDA code on the sim device")
    group.addoption("--sim-cuda", action="store_true", default=False,
                    help="run the tests with 'cuda' mapped to sim devices; a test that races "
                         "fails with the race report")
    group.addoption("--sim-devices", type=int, default=2, metavar="N",
                    help="number of CUDA devices the tests see (default 2)")
    group.addoption("--sim-async", action="store_true", default=False,
                    help="asynchronous sim: kernels run on stream threads")


def pytest_configure(config: pytest.Config) -> None:
    global _session
    if not config.getoption("--sim-cuda") or _session is not None:
        return
    import torch_pipeline.sim as sim

    _session = contextlib.ExitStack()
    _session.enter_context(sim.as_cuda(devices=config.getoption("--sim-devices"),
                                       asynchronous=config.getoption("--sim-async")))


def pytest_unconfigure(config: pytest.Config) -> None:
    global _session
    if _session is not None:
        _session.close()
        _session = None


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    if _session is None:
        return None
    return (f"torch_pipeline.sim: 'cuda' is {config.getoption('--sim-devices')} sim device(s)"
            f"{' (asynchronous)' if config.getoption('--sim-async') else ''}; racing tests fail")


class RaceFound(AssertionError):
    """The test's ops raced (the message is the report)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    if _session is None:
        return (yield)
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

    sim.clear_races()
    try:
        result = yield
    finally:
        # The host waits for every stream, so what this test left running cannot race with the
        # next test (its blocks reused there, say): each test is charged its own races.
        _C._sim_synchronize(-1)  # every device
        races = sim.races()
        sim.clear_races()
    if races:
        raise RaceFound("\n" + sim.report(races, cuda_names=True))
    return result
