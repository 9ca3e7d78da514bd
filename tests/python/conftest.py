"""Shared fixtures and markers for the torch_pipeline tests.

GPU tests are marked ``@pytest.mark.gpu`` and skipped when no CUDA device is present.
"""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
