"""Communication streams with NCCL (world size 1; skipped without a GPU, run by gpu_check.sh).

The program (_nccl_program.py, a process of its own) produces a tensor late on a pipeline (a
calibrated torch.cuda._sleep), all-gathers it inside tp.collective() (ProcessGroupNCCL launches
async_op=False collectives on the current stream since torch 2.8: the comm stream) and consumes
the result on the default stream. With tracking every value is right; without it the collective
reads the tensor before its producer wrote it. Under the CUDA sanitizer the tracked run reports
nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()),
                                 reason="needs NCCL")]
HERE = os.path.dirname(os.path.abspath(__file__))


def run(*args: str, sanitize: bool = False) -> Dict[str, Any]:
    env = dict(os.environ)
    if sanitize:
        env["TORCH_CUDA_SANITIZER"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_nccl_program.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CSAN" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_collectives_in_collective_run_on_the_comm_stream_and_are_ordered() -> None:
    r = run()
    assert r["comm_stream_current"]
    assert r["values"] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_without_tracking_the_collective_reads_too_early() -> None:
    r = run("untracked")
    assert r["values"] != [1.0, 2.0, 3.0, 4.0, 5.0], "no race window: the test proves nothing"


def test_async_collectives_waited_on_another_pipeline_are_ordered() -> None:
    r = run("async")
    assert r["values"] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_the_cuda_sanitizer_reports_nothing() -> None:
    r = run(sanitize=True)
    assert r["values"] == [1.0, 2.0, 3.0, 4.0, 5.0]
