"""Shared fixtures and markers for the torch_pipeline tests.

GPU tests are marked ``@pytest.mark.gpu`` and skipped when no CUDA device is present.
"""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    # scripts/test_wheel.sh: the tests must run against the installed wheel, never a source tree.
    installed = os.environ.get("TORCH_PIPELINE_TEST_INSTALLED")
    if not installed:
        return
    import torch_pipeline

    where = os.path.realpath(torch_pipeline.__file__)
    if not where.startswith(os.path.realpath(installed) + os.sep):
        raise pytest.UsageError(
            f"TORCH_PIPELINE_TEST_INSTALLED={installed}, but torch_pipeline was imported from "
            f"{where}: run pytest from outside the source tree"
        )


def _has_cxx_compiler() -> bool:
    # scripts/test_wheel.sh replaces the compilers on PATH with stubs that fail.
    try:
        return subprocess.run(["g++", "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cxx = _has_cxx_compiler()
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "compiler" in item.keywords and not has_cxx:
            item.add_marker(pytest.mark.skip(reason="needs a C++ compiler (g++ on PATH)"))


@pytest.fixture(scope="session")
def cycles_per_ms() -> float:
    """torch.cuda._sleep cycles per millisecond on this GPU (calibrated once): GPU tests open race
    windows with it, so that a missing wait shows up as a wrong value rather than by luck."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / start.elapsed_time(end)
