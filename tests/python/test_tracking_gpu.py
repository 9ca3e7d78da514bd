"""GPU twins of the automatic-synchronization tests (test_tracking.py runs them on the sim device).

Each rule of docs/design.md, "The rules", gets a program whose race window is opened with a
calibrated torch.cuda._sleep: with tracking it computes the right value; with tracking switched off
(the test-only switch) the same program computes a wrong one, so the test fails when the behaviour
is removed. The random programs of _programs.py run under PyTorch's CUDA sanitizer
(TORCH_CUDA_SANITIZER=1), which must report nothing, and report races when tracking is off. Skipped
without a GPU; run by scripts/gpu_check.sh.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Callable, Iterator

import pytest
import torch

import torch_pipeline as tp

pytestmark = pytest.mark.gpu

N = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    tp._C._set_tracking_enabled(False)
    try:
        yield
    finally:
        tp._C._set_tracking_enabled(True)


def both_ways(program: Callable[[], float], expected: float) -> None:
    """The program computes `expected` with tracking and something else without it."""
    torch.cuda.synchronize()
    assert program() == expected
    torch.cuda.synchronize()
    with untracked():
        got = program()
        torch.cuda.synchronize()
    assert got != expected, "the program computed the right value without tracking: no race window"


def test_read_after_write(cycles_per_ms: float) -> None:
    p = tp.Pipeline()

    def program() -> float:
        x = torch.zeros(N, device="cuda")
        torch.cuda.synchronize()
        with tp.pipeline(p):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            x.fill_(1.0)                     # the writer, late, on p's stream
        return (x + 1).sum().item()          # the reader, on the default stream

    both_ways(program, 2.0 * N)


def test_write_after_read(cycles_per_ms: float) -> None:
    p = tp.Pipeline()

    def program() -> float:
        x = torch.ones(N, device="cuda")
        torch.cuda.synchronize()
        with tp.pipeline(p):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            y = x * 2                        # the reader, late
        x.fill_(5.0)                         # the writer, on the default stream
        p.synchronize()
        torch.cuda.synchronize()
        return y.sum().item()

    both_ways(program, 2.0 * N)


def test_write_after_write(cycles_per_ms: float) -> None:
    p = tp.Pipeline()

    def program() -> float:
        x = torch.zeros(N, device="cuda")
        torch.cuda.synchronize()
        with tp.pipeline(p):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            x.fill_(3.0)                     # first writer, late
        x.fill_(4.0)                         # second writer: must land last
        p.synchronize()
        torch.cuda.synchronize()
        return x.sum().item()

    both_ways(program, 4.0 * N)


def test_non_blocking_copy_to_the_host_then_cpu_read(cycles_per_ms: float) -> None:
    p = tp.Pipeline()

    def program() -> float:
        x = torch.zeros(N, device="cuda")
        torch.cuda.synchronize()
        with tp.pipeline(p):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            x.fill_(3.0)
            host = x.to("cpu", non_blocking=True)
        return host.sum().item()             # a CPU op: waits for the copy

    both_ways(program, 3.0 * N)


def test_memory_freed_after_a_cross_stream_use(cycles_per_ms: float) -> None:
    p = tp.Pipeline()

    def program() -> float:
        x = torch.full((N,), 1.0, device="cuda")
        torch.cuda.synchronize()
        with tp.pipeline(p):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            y = x * 2                        # reads x late
        del x                                # freed on the default stream
        z = torch.full((N,), 9.0, device="cuda")  # would take x's block at once
        p.synchronize()
        del z
        return y.sum().item()

    both_ways(program, 2.0 * N)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cross_device(cycles_per_ms: float) -> None:
    p0, p1 = tp.Pipeline(), tp.Pipeline()

    def program() -> float:
        with tp.pipeline(p0):
            torch.cuda._sleep(int(50 * cycles_per_ms))
            a = torch.full((N,), 2.0, device="cuda:0")
        with tp.pipeline(p1):
            b = a.to("cuda:1") * 3
        return b.sum().item()

    both_ways(program, 6.0 * N)


def test_random_programs_match_the_default_pipeline() -> None:
    from _programs import check_programs

    keep_live = tp.Pipeline()
    devices = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
    assert check_programs(100, devices) == 100
    del keep_live


def run_sanitized(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    return subprocess.run([sys.executable, os.path.join(HERE, "_programs.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_random_programs_under_the_cuda_sanitizer() -> None:
    proc = run_sanitized("cuda", "30")
    assert proc.returncode == 0 and "CSAN" not in proc.stderr, proc.stderr[-4000:]
    assert "checked 30 programs" in proc.stdout


def test_the_cuda_sanitizer_sees_the_races_without_tracking() -> None:
    proc = run_sanitized("cuda", "30", "untracked")
    assert proc.returncode != 0 and "CSAN" in proc.stderr, (proc.stdout + proc.stderr)[-4000:]
