"""Collectives under pipelines with torch.distributed (Gloo on the CPU, ranks on loopback).

Each multi-process test spawns its ranks (tests/python/_dist_ranks.py) and bounds them with a
timeout: a deadlock fails the test instead of hanging it. The communication-stream side of
tp.collective() needs an accelerator: it is tested on the sim device (test_tracking.py) and on
CUDA with NCCL (test_comm_gpu.py).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import torch_pipeline as tp

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(program: str, world: int = 2, timeout_s: float = 240.0) -> List[Dict[str, Any]]:
    """Runs `program` on `world` ranks; returns each rank's result (fails on error or timeout)."""
    port = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_dist_ranks.py"), program, str(r), str(world),
             port, outs[r]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)]
        logs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=timeout_s)
                logs.append(out)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{program}: the ranks did not finish within {timeout_s:.0f} s (deadlock?)")
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} of {program} failed:\n{logs[r][-4000:]}"
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
        return results


def test_collectives_from_two_worker_threads_while_the_main_thread_computes() -> None:
    results = run_ranks("two_worker_threads")
    for rank, r in enumerate(results):
        assert r["iterations"] >= 100
        assert r["wrong"] == 0, f"rank {rank}: {r['wrong']} results were not exact"
        assert r["same_order"], "the thread groups differ between ranks"
        assert r["groups"] == tp.max_worker_threads()
        assert r["hazards"] == []


def test_debug_mode_reports_a_group_used_from_two_threads() -> None:
    for r in run_ranks("shared_group"):
        assert r["clean"] == [], "thread groups used one per thread were reported"
        # The default group: the main thread used it (thread_groups() itself), then worker
        # thread 1, then worker thread 2: two changes of thread, two reports.
        assert len(r["hazards"]) == 2, r["hazards"]
        assert "from worker thread 1, which thread" in r["hazards"][0]
        assert "from worker thread 2, which worker thread 1 also issues" in r["hazards"][1]
        assert all("thread_groups" in h for h in r["hazards"])


def test_thread_groups_needs_an_initialized_process_group() -> None:
    import torch_pipeline.distributed as tpd

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        tpd.thread_groups()


def test_work_waits_are_hooked() -> None:
    """Work.wait / synchronize / block_current_stream tell automatic synchronization that an
    async collective's outputs are ready (torch_pipeline wraps them on first need, here the first
    collective())."""
    tp.collective()
    work = torch._C._distributed_c10d.Work
    for name in ("wait", "synchronize", "block_current_stream"):
        if hasattr(work, name):
            assert getattr(getattr(work, name), "_torch_pipeline_hook", False), name


_WORK_HOOKS_PROGRAM = """
import os, sys, tempfile
import torch
import torch.distributed as dist

c10d = torch._C._distributed_c10d
classes = [c for c in vars(c10d).values() if isinstance(c, type) and issubclass(c, c10d.Work)]
names = ("wait", "synchronize", "block_current_stream")
before = {(c, n): c.__dict__.get(n) for c in classes for n in names}
assert any(f is not None for f in before.values())

def untouched():
    return all(c.__dict__.get(n) is f for (c, n), f in before.items())

def hooked():
    return all(getattr(c.__dict__[n], "_torch_pipeline_hook", False)
               for (c, n), f in before.items() if f is not None)

def init():
    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)

import torch_pipeline as tp
import torch_pipeline.distributed as tpd
p = tp.Pipeline(1)
assert p.submit(lambda: 1).wait() == 1  # not distributed: nothing to hook
print("IMPORTED", untouched(), flush=True)
how = sys.argv[1]
if how == "collective":
    tp.collective()
elif how == "thread_groups":
    init()
    print("INITIALIZED", untouched(), flush=True)
    tpd.thread_groups()
elif how == "pipeline":
    init()
    print("INITIALIZED", untouched(), flush=True)
    tp.Pipeline()
elif how == "submit":
    init()
    print("INITIALIZED", untouched(), flush=True)
    p.submit(lambda: 2).wait()
print("HOOKED", hooked(), flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("how", ["collective", "thread_groups", "pipeline", "submit"])
def test_work_hooks_are_installed_on_first_need_not_at_import(how: str) -> None:
    """`import torch_pipeline` changes nothing in torch: c10d's Work (and its subclasses) keep
    their own wait/synchronize/block_current_stream until torch_pipeline first needs the hooks:
    the first collective(), thread_groups(), or a Pipeline created or a task submitted while
    torch.distributed is initialized."""
    proc = subprocess.run([sys.executable, "-c", _WORK_HOOKS_PROGRAM, how], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    expected = ["IMPORTED", "True"]
    if how != "collective":
        expected += ["INITIALIZED", "True"]
    assert lines == expected + ["HOOKED", "True"], proc.stdout + proc.stderr


def test_tp_distributed_is_the_module() -> None:
    import torch_pipeline.distributed as tpd

    assert tp.distributed is tpd
    with pytest.raises(AttributeError):
        tp.no_such_thing  # noqa: B018


def test_collective_and_comm_stream_on_the_cpu() -> None:
    """Without an accelerator there are no streams: collective() changes nothing and
    comm_stream() is None; bad arguments still raise."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with tp.collective() as c:
        assert isinstance(c, tp.collective)
    assert tp.comm_stream() is None
    assert tp.comm_stream("cpu") is None
    with pytest.raises(TypeError, match="device must be"):
        tp.comm_stream(3.5)  # type: ignore[arg-type]
    block = tp.collective()
    with block:
        with pytest.raises(RuntimeError, match="already entered"):
            block.__enter__()


def test_the_overlap_example_runs_and_matches_the_plain_run() -> None:
    """examples/overlap_allreduce.py (2 ranks it spawns itself, a small model): the overlapped run
    ends with the same parameters as the plain one on every rank."""
    root = os.path.dirname(os.path.dirname(HERE))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "overlap_allreduce.py"), "--device", "cpu",
         "--steps", "4", "--width", "256", "--depth", "3", "--bucket-mb", "0.25"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "check passed" in proc.stdout
