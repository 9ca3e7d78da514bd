"""Random single-thread programs over several pipelines and two devices (docs/design.md,
"Automatic synchronization"): a program using any pipelines computes bit for bit what it computes
when every pipeline is the default one.

A program is a list of steps ``(pipeline index, op, operands)`` over a few tensor slots; run it
with four pipelines (index 0 is always the default pipeline) or with ``[None] * 4`` for the
reference. Used by test_tracking.py on the sim device and by test_tracking_gpu.py on CUDA (also
under PyTorch's CUDA sanitizer).

    python tests/python/_programs.py cuda 50 [untracked]   # 50 programs on cuda:0/1, checked
"""
from __future__ import annotations

import random
import sys
from typing import List, Optional, Sequence, Tuple

import torch

import torch_pipeline as tp

Program = List[Tuple[int, str, Tuple[int, ...]]]
SLOTS = 6
OPS = ("new", "unary", "binary", "inplace", "slice", "to_other", "copy", "out", "host", "del")


def make_program(rng: random.Random, length: int = 24) -> Program:
    """A random program of ``length`` steps."""
    return [(rng.randrange(4), rng.choice(OPS), tuple(rng.randrange(SLOTS) for _ in range(3)))
            for _ in range(length)]


def make_pipelines(rng: random.Random) -> List[Optional[tp.Pipeline]]:
    """The default pipeline and three others (two worker threads, two priorities)."""
    workers = [tp.get_worker_thread(i) for i in range(2)]
    return [None, tp.Pipeline(), tp.Pipeline(rng.choice(workers)), tp.Pipeline(priority=-1)]


def run_program(program: Program, pipelines: Sequence[Optional[tp.Pipeline]], seed: int,
                devices: Sequence[str], numel: int = 256) -> List[torch.Tensor]:
    """Runs ``program``; returns the final values of its slots and what it read on the host."""
    g = torch.Generator().manual_seed(seed)
    slots: List[Optional[torch.Tensor]] = [None] * SLOTS
    host_values: List[torch.Tensor] = []

    def other(device: torch.device) -> str:
        return devices[1] if str(device) == devices[0] else devices[0]

    def get(i: int, device: Optional[str] = None) -> torch.Tensor:
        t = slots[i]
        if t is None:
            t = slots[i] = torch.randn(numel, generator=g).to(devices[i % len(devices)])
        return t if device is None or str(t.device) == device else t.to(device)

    for which, op, (a, b, c) in program:
        with tp.pipeline(pipelines[which]):
            if op == "new":
                slots[a] = torch.randn(numel, generator=g).to(devices[b % len(devices)])
            elif op == "unary":
                slots[a] = torch.sin(get(b)) * 0.5
            elif op == "binary":
                x = get(b)
                slots[a] = x + get(c, str(x.device))
            elif op == "inplace":
                x = get(a)
                x.add_(get(b, str(x.device)), alpha=0.25)
            elif op == "slice":
                get(a)[::2].mul_(-1.0)
            elif op == "to_other":
                x = get(b)
                slots[a] = x.to(other(x.device))
            elif op == "copy":
                x = get(a)
                x.copy_(get(b, str(x.device)))
            elif op == "out":
                x = get(b)
                out = get(a)
                if out.device == x.device:
                    torch.mul(x, get(c, str(x.device)), out=out)
            elif op == "host":
                h = get(a).to("cpu", non_blocking=True)
                host_values.append(h.sum().reshape(1))  # a CPU op reading the copy's result
            elif op == "del":
                slots[a] = None
    return [t.cpu() for t in slots if t is not None] + host_values


def check_programs(count: int, devices: Sequence[str], seed: int = 1234) -> int:
    """Runs ``count`` random programs with pipelines and on the default pipeline; raises
    AssertionError on the first difference. Returns the number checked."""
    rng = random.Random(seed)
    for n in range(count):
        program = make_program(rng)
        reference = run_program(program, [None] * 4, n, devices)
        got = run_program(program, make_pipelines(rng), n, devices)
        assert len(reference) == len(got)
        for r, x in zip(reference, got):
            assert torch.equal(r, x), f"program {n} computed other values: {program}"
    return count


if __name__ == "__main__":
    kind, count = sys.argv[1], int(sys.argv[2])
    n_dev = torch.cuda.device_count() if kind == "cuda" else 2
    devs = [f"{kind}:{i % max(1, n_dev)}" for i in range(2)]
    if sys.argv[3:] == ["untracked"]:
        tp._C._set_tracking_enabled(False)  # the test-only switch: races show
    keep_live = tp.Pipeline()  # the reference runs tracked too (its host reads are synchronized)
    print(f"checked {check_programs(count, devs)} programs on {devs}")
