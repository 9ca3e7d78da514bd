"""The sim device is the CPU's twin on PyTorch's whole operator database (docs/design.md,
"What it simulates").

Every OpInfo op and variant of ``op_db``, for float32, float64, int64, bool, bfloat16, float16 and
complex64, up to three samples each: results, gradients (where OpInfo says the op supports
autograd) and forward-mode tangents (where it supports forward AD; not for the half types) on sim
equal the CPU's bit for bit, in synchronous and asynchronous mode, with no race and no warning
the CPU does not give; and again with every op inside ``with tp.pipeline(p)``, automatic
synchronization ordering it against the sample's producers and the CPU reads. The sweep and its list of exclusions (each with its reason)
are in _opinfo_sweep.py; ``python tests/python/_opinfo_sweep.py --async`` prints the numbers.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, List

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, sim_enabled_fixture

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from _opinfo_sweep import Report, sweep

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")
pytestmark = pytest.mark.timeout(1500)  # the proxies wait for the whole sweep's child process

_sim_enabled = sim_enabled_fixture(num_devices=1)

# TORCH_PIPELINE_OPINFO_GROUPS="float32" (names separated by ";") sweeps only those groups: for the
# CI configurations after the first one, whose build differs but whose sim kernels do not.
_ALL_GROUPS: Dict[str, List[torch.dtype]] = {
    "float32": [torch.float32],
    "float64,complex64": [torch.float64, torch.complex64],
    "int64,bool": [torch.int64, torch.bool],
    "bfloat16,float16": [torch.bfloat16, torch.float16],
}
_ONLY = os.environ.get("TORCH_PIPELINE_OPINFO_GROUPS")
GROUPS = {k: v for k, v in _ALL_GROUPS.items() if _ONLY is None or k in _ONLY.split(";")}
# Fewer compared op x dtype pairs than this means samples were skipped wholesale (torch 2.13: 667
# float32 pairs; the groups below about 70% of their count, as op_db changes between versions).
MIN_PAIRS = {"float32": 550, "float64,complex64": 900, "int64,bool": 450, "bfloat16,float16": 800}


@pytest.fixture(autouse=True)
def _mode() -> Iterator[None]:
    yield
    if IN_CHILD:
        sim.set_asynchronous(False)
        sim.clear_latency()


def _check(report: "Report", group: str, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\n{report.line()} [{group}]")
    problems = {**{f"differ: {k}": v for k, v in report.differ.items()},
                **{f"fails on sim only: {k}": v for k, v in report.sim_only.items()},
                **{f"warns on sim only: {k}": v for k, v in report.warns.items()}}
    assert not problems, "\n".join(f"{k}: {v}" for k, v in sorted(problems.items()))
    assert report.races == 0
    assert report.pairs >= MIN_PAIRS[group], report.line()


@pytest.mark.parametrize("mode", ["synchronous", "asynchronous"])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_opinfo_sample_equals_the_cpu(mode: str, group: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _check(sweep(GROUPS[group], asynchronous=mode == "asynchronous"), group, capsys)


@pytest.mark.parametrize("mode", ["synchronous", "asynchronous"])
def test_every_opinfo_sample_in_a_pipeline_equals_the_cpu(
        mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The samples are made on the default stream and read back there; the ops run on a worker
    stream: no manual synchronization anywhere."""
    p = tp.Pipeline()
    _check(sweep(_ALL_GROUPS["float32"], asynchronous=mode == "asynchronous", pipeline=p),
           "float32", capsys)


# The sweep's tests split over two child processes at once where there are two cores to run them.
install_proxies(globals(), __file__, timeout_s=1500.0, shards=min(2, os.cpu_count() or 1))
