"""Shared helpers for the torch_pipeline benchmarks (bench_context.py, bench_submit.py).

Every variant of a benchmark is a function ``run(n)`` that performs ``n`` operations. The variants
run interleaved, in rounds, in one process: each round runs every variant once (in a rotated
order, so that no variant always runs first or right after the same neighbour), and the median
over the rounds is reported. Interleaving makes slow drift of the machine (frequency scaling,
noisy neighbours) hit all variants alike, so the ratios are more stable than the absolute times.

With ``TORCH_PIPELINE_BENCH_RECORDS=FILE`` in the environment every ratio and target printed is
also appended to FILE as one JSON object a line (``record``); scripts/gpu_check.sh collects them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence


@dataclass(frozen=True)
class Variant:
    """One thing to time: ``run(n)`` performs ``n`` operations; a round calls it once with
    ``iterations``."""

    name: str
    run: Callable[[int], None]
    iterations: int


@dataclass(frozen=True)
class Target:
    """``median(numerator) <= limit * median(denominator)``."""

    numerator: str
    denominator: str
    limit: float
    label: str


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer rounds and iterations")
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when a target is missed"
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 7, quick 3)")


def time_rounds(variants: Sequence[Variant], rounds: int, warmup: bool = True) -> Dict[str, List[float]]:
    """Nanoseconds per operation of every variant, one sample per round."""
    samples: Dict[str, List[float]] = {v.name: [] for v in variants}
    if warmup:
        for v in variants:
            v.run(max(1, v.iterations // 10))
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            k = r % len(variants)
            for v in list(variants[k:]) + list(variants[:k]):
                t0 = time.perf_counter_ns()
                v.run(v.iterations)
                t1 = time.perf_counter_ns()
                samples[v.name].append((t1 - t0) / v.iterations)
            gc.collect()  # between rounds, outside the timed regions
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratios(samples: Dict[str, List[float]], numerator: str, denominator: str) -> List[float]:
    """Per-round ratios numerator/denominator, sorted: time_rounds runs both in every round, so a
    round's ratio cancels the machine's slow drift, which the ratio of medians does not."""
    return sorted(a / b for a, b in zip(samples[numerator], samples[denominator]))


def print_table(samples: Dict[str, List[float]], unit: str = "ns", scale: float = 1.0) -> None:
    width = max(len(n) for n in samples)
    print(f"{'variant':<{width}}  {'median':>11}  {'min':>11}  {'max':>11}   ({unit} per op)")
    for name, xs in samples.items():
        print(
            f"{name:<{width}}  {median(xs) / scale:>11.1f}  {min(xs) / scale:>11.1f}  "
            f"{max(xs) / scale:>11.1f}"
        )


def record(kind: str, **fields: object) -> None:
    """Appends ``{"bench": <script>, "kind": kind, **fields}`` as a JSON line to the file named by
    TORCH_PIPELINE_BENCH_RECORDS (nothing when unset), for scripts/gpu_check.sh's summary.

    >>> record("ratio", numerator="live", denominator="idle", ratio=1.04)
    """
    path = os.environ.get("TORCH_PIPELINE_BENCH_RECORDS")
    if not path:
        return
    bench = os.path.splitext(os.path.basename(sys.argv[0] or "?"))[0]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"bench": bench, "kind": kind, **fields}) + "\n")


def check_targets(samples: Dict[str, List[float]], targets: Sequence[Target]) -> bool:
    """Prints one PASS/FAIL line per target; returns whether all passed."""
    ok = True
    for t in targets:
        ratio = median(samples[t.numerator]) / median(samples[t.denominator])
        passed = ratio <= t.limit
        ok &= passed
        print(
            f"{'PASS' if passed else 'FAIL'}  {t.label}: {t.numerator} / {t.denominator} = "
            f"{ratio:.2f}x (target <= {t.limit:g}x)"
        )
        record("target", label=t.label, numerator=t.numerator, denominator=t.denominator,
               ratio=round(ratio, 4), target=f"<= {t.limit:g}", passed=passed)
    return ok


def print_ratio(samples: Dict[str, List[float]], numerator: str, denominator: str) -> None:
    ratio = median(samples[numerator]) / median(samples[denominator])
    print(f"ratio {numerator} / {denominator} = {ratio:.2f}x")
    record("ratio", numerator=numerator, denominator=denominator, ratio=round(ratio, 4))


def finish(all_passed: bool, check: bool) -> int:
    if all_passed:
        print("all targets met")
        return 0
    print("some targets missed" + ("" if check else " (exit status 0: pass --check to fail)"))
    return 1 if check else 0


def environment_line() -> str:
    import platform

    import torch

    cuda = torch.cuda.is_available()
    dev = torch.cuda.get_device_name(0) if cuda else "no CUDA"
    return (
        f"python {platform.python_version()}, torch {torch.__version__}, {dev}, "
        f"{platform.machine()} {_cpu_count()} CPUs"
    )


def _cpu_count() -> Optional[int]:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count()
