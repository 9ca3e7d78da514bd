"""CPU twins of GPU-only numbers, on the sim device in asynchronous mode with a latency model.

Two benchmarks, each run side by side (interleaved rounds, medians; see _harness.py):

* **Two independent latency-bound branches**: two chains of small kernels that each take the
  modelled launch latency (``--launch-us``, default 2000 us), on one stream vs on two pipelines
  (joined by an op on the default stream, which tracking orders after both). Streams overlap, so
  two pipelines take about half the time of one stream (target >= 1.7x).
* **The print(loss) stall**: a training-like step (a chain of latency-bound kernels ending in a
  loss), logging the loss every step. Naive: ``loss.item()`` in the loop waits for the step, so the
  host stops issuing work while the device runs. Pipelined: the loss is handed to a logging
  pipeline on worker thread 1 (``logger.submit(log, i, loss.detach())``), whose ``item()`` waits
  there. Anchors: the same loop without logging (targets: pipelined >= 1.3x naive, within 5% of no
  logging).

The model's times are sleeps of the streams' threads, so the ratios show on a 2-core machine; the
absolute times are the model's, not a GPU's.

    python bench/bench_sim_async.py [--quick] [--check] [--launch-us US]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List

import torch

import torch_pipeline as tp
import torch_pipeline.sim as sim

sys.path.insert(0, __file__.rsplit("/", 1)[0])
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

NUMEL = 1024


def chain(x: torch.Tensor, length: int) -> torch.Tensor:
    for _ in range(length):
        x = x * 1.0001
    return x


def branches_variants(length: int) -> List[Variant]:
    x = torch.ones(NUMEL, device="sim:0")
    p1, p2 = tp.Pipeline(), tp.Pipeline()

    def one_stream(n: int) -> None:
        for _ in range(n):
            a = chain(x, length)
            b = chain(x, length)
            (a + b).sum().item()

    def two_pipelines(n: int) -> None:
        for _ in range(n):
            with tp.pipeline(p1):
                a = chain(x, length)
            with tp.pipeline(p2):
                b = chain(x, length)
            (a + b).sum().item()   # waits for both branches (tracking orders the add)

    return [Variant("branches: one stream", one_stream, 1),
            Variant("branches: two pipelines", two_pipelines, 1)]


def logging_variants(steps: int, length: int, host_s: float) -> List[Variant]:
    x = torch.ones(NUMEL, device="sim:0")
    logger = tp.Pipeline(tp.get_worker_thread(1))
    logged: List[float] = []

    def step() -> torch.Tensor:
        time.sleep(host_s)   # the host's own work per step (loading the next batch, say)
        return chain(x, length).mean()

    def log(i: int, loss: torch.Tensor) -> None:
        logged.append(loss.item())

    def no_logging(n: int) -> None:
        for _ in range(n):
            for _ in range(steps):
                step()
            torch.accelerator.synchronize()

    def naive(n: int) -> None:
        for _ in range(n):
            for i in range(steps):
                log(i, step())
            torch.accelerator.synchronize()

    def pipelined(n: int) -> None:
        for _ in range(n):
            for i in range(steps):
                logger.submit(log, i, step().detach())
            logger.synchronize()
            torch.accelerator.synchronize()

    return [Variant("logging: none", no_logging, 1),
            Variant("logging: naive loss.item()", naive, 1),
            Variant("logging: pipelined", pipelined, 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--launch-us", type=float, default=2000.0,
                        help="modelled launch latency of every kernel (default 2000 us)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    sim.enable(num_devices=1, asynchronous=True)
    print(environment_line())
    print(f"sim, asynchronous mode, launch latency {args.launch_us:g} us per kernel")
    sim.set_latency(launch_us=args.launch_us)
    length = 10 if args.quick else 20
    step_length = length // 2
    host_s = step_length * args.launch_us / 1e6  # as long as the step's device time
    variants: List[Variant] = (branches_variants(length) +
                               logging_variants(4, step_length, host_s))
    samples = time_rounds(variants, rounds)
    print_table(samples, unit="ms", scale=1e6)
    speedups = [
        Target("branches: two pipelines", "branches: one stream", 1 / 1.7,
               "two latency-bound branches on two pipelines, >= 1.7x one stream"),
        Target("logging: pipelined", "logging: naive loss.item()", 1 / 1.3,
               "print(loss) stall: pipelined logging >= 1.3x the naive loop"),
        Target("logging: pipelined", "logging: none", 1.05,
               "pipelined logging within 5% of the loop without logging"),
    ]
    ok = check_targets(samples, speedups)
    return finish(ok, args.check)


if __name__ == "__main__":
    sys.exit(main())
