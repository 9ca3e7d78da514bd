"""Latency and throughput of ``Pipeline.submit`` next to ``concurrent.futures.ThreadPoolExecutor``.

What is measured (``p = tp.Pipeline(1)``, a pipeline on worker thread 1; ``ex =
ThreadPoolExecutor(1)``, created once; ``f`` a no-op function):

* round trip -- ``p.submit(f).wait()`` vs ``ex.submit(f).result()``: one task submitted and waited
  for before the next; the latency of handing work to another thread and getting the result
  back. Reported in microseconds per task.
* bulk       -- 20k no-op tasks submitted, then all their futures waited for, vs the same with
  the executor: the per-task overhead when the queue stays busy (what ``logger.submit(...)``
  every training step costs). Reported in microseconds per task (20k tasks per sample).

The variants run interleaved in rounds in one process (default 9 rounds; a round trip sample is
2000 tasks) and the median per variant is reported. On a machine with CUDA, torch_pipeline's
tasks are device-aware: every submit records a CUDA event on the submitter's current stream, the
task's stream waits for it, and ``wait()`` makes the waiter's stream wait for the task's end; the
executor does none of that, and the comparison includes that cost. How to read the output: the table gives median/min/max microseconds per
task; then the ratios tp / executor, and the targets

* round trip <= 0.7x the executor's, and
* bulk       <= 0.5x the executor's,

one PASS/FAIL line each. The exit status is 0 unless ``--check`` is given and a target is missed.
``--quick`` runs fewer rounds and tasks (a smoke test; the numbers are noisier).

    python bench/bench_submit.py [--quick] [--check] [--rounds N] [--round-trips N] [--bulk N]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
from typing import Callable, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import torch_pipeline as tp  # noqa: E402
from _harness import (  # noqa: E402
    Target,
    Variant,
    add_common_args,
    check_targets,
    environment_line,
    finish,
    print_table,
    time_rounds,
)

TP_RT = "tp round trip"
EX_RT = "executor round trip"
TP_BULK = "tp bulk"
EX_BULK = "executor bulk"


def noop() -> None:
    """The task: does nothing, so only the submit/run/complete machinery is timed."""


def make_variants(
    p: tp.Pipeline, ex: concurrent.futures.ThreadPoolExecutor, round_trips: int, bulk: int
) -> List[Variant]:
    def tp_round_trip(n: int, submit: Callable = p.submit, f: Callable = noop) -> None:
        for _ in range(n):
            submit(f).wait()

    def ex_round_trip(n: int, submit: Callable = ex.submit, f: Callable = noop) -> None:
        for _ in range(n):
            submit(f).result()

    def tp_bulk(n: int, submit: Callable = p.submit, f: Callable = noop) -> None:
        futures = [submit(f) for _ in range(n)]
        for fut in futures:
            fut.wait()

    def ex_bulk(n: int, submit: Callable = ex.submit, f: Callable = noop) -> None:
        futures = [submit(f) for _ in range(n)]
        for fut in futures:
            fut.result()

    return [
        Variant(TP_RT, tp_round_trip, round_trips),
        Variant(EX_RT, ex_round_trip, round_trips),
        Variant(TP_BULK, tp_bulk, bulk),
        Variant(EX_BULK, ex_bulk, bulk),
    ]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--round-trips", type=int, default=None, help="round trips per round (default 2000, quick 1000)"
    )
    parser.add_argument(
        "--bulk", type=int, default=None, help="tasks per bulk sample (default 20000, quick 5000)"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 9)
    round_trips = args.round_trips or (1_000 if args.quick else 2_000)
    bulk = args.bulk or (5_000 if args.quick else 20_000)

    p = tp.Pipeline(1)
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        print(f"bench_submit: {environment_line()}")
        print(f"pipeline: {p!r}; f = a no-op function")
        if torch.cuda.is_available():
            print("CUDA is initialized: each tp task records and waits for CUDA events")
        print(
            f"{rounds} rounds, interleaved; round trip: {round_trips} tasks per sample, bulk: "
            f"{bulk} tasks submitted then all waited per sample"
        )
        samples = time_rounds(make_variants(p, ex, round_trips, bulk), rounds)
    finally:
        ex.shutdown(wait=True)
    print()
    print_table(samples, unit="us", scale=1000.0)
    print()
    ok = check_targets(
        samples,
        [
            Target(TP_RT, EX_RT, 0.7, "round trip <= 0.7x executor"),
            Target(TP_BULK, EX_BULK, 0.5, "bulk <= 0.5x executor"),
        ],
    )
    return finish(ok, args.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
