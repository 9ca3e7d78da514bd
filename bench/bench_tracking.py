"""Per-op cost of automatic synchronization (DESIGN.md §4: "the tracker costs nothing measurable
while no non-default pipeline is alive, and little when one is").

What is measured: the wall time of ``torch.add(a, b)`` on small tensors (8 elements), in a tight
Python loop, in these states:

* ``not imported``  -- torch_pipeline never imported (a separate Python process)
* ``idle``          -- torch_pipeline imported, no non-default pipeline alive: no callback is
                       installed, ops pay nothing
* ``live``          -- a non-default pipeline alive (tracking live), the op on the default stream:
                       every op is observed
* ``live, in p``    -- the same inside ``with p:`` (the op on the pipeline's stream; devices
                       only, since CPU tensors have no streams)

on CPU tensors; on sim tensors (the simulated accelerator of DESIGN.md §5, whose ops cost a few
microseconds, like a kernel launch); and on CUDA tensors when a GPU is present (there the loop
only launches kernels: the ratio is the tracker's share of the launch cost). ``live`` and ``idle`` run interleaved in rounds in one process; ``not imported`` vs
``idle`` alternate between two child processes, one round each per turn, and compare medians.

Targets (issue 4): live <= 1.25x idle, idle <= 1.03x not imported. One PASS/FAIL line each. The
exit status is 0 unless ``--check`` is given and a target is missed. ``--quick`` runs fewer rounds.

    python bench/bench_tracking.py [--quick] [--check] [--rounds N] [--iterations N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import (  # noqa: E402
    Target,
    Variant,
    add_common_args,
    check_targets,
    environment_line,
    finish,
    median,
    print_table,
    time_rounds,
)

NOT_IMPORTED = "not imported"
IDLE = "idle"
LIVE = "live"
LIVE_IN_P = "live, in p"


def _add_loop(device: str):  # type: ignore[no-untyped-def]
    import torch

    a = torch.ones(8, device=device)
    b = torch.ones(8, device=device)

    def run(n: int) -> None:
        add = torch.add
        for _ in range(n):
            add(a, b)

    return run


def child(mode: str, iterations: int, rounds: int) -> None:
    """One process's samples (ns per op) for ``mode`` on CPU tensors, as JSON on stdout."""
    if mode == IDLE:
        import torch_pipeline  # noqa: F401
    run = _add_loop("cpu")
    samples = time_rounds([Variant(mode, run, iterations)], rounds)
    print(json.dumps(samples[mode]))


def across_processes(iterations: int, rounds: int) -> Dict[str, List[float]]:
    """``not imported`` vs ``idle``: alternating child processes, one sample each per turn."""
    samples: Dict[str, List[float]] = {NOT_IMPORTED: [], IDLE: []}
    for r in range(rounds):
        order = [NOT_IMPORTED, IDLE] if r % 2 == 0 else [IDLE, NOT_IMPORTED]
        for mode in order:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", mode,
                 "--iterations", str(iterations), "--rounds", "3"],
                check=True, capture_output=True, text=True).stdout
            samples[mode].append(median(json.loads(out.strip().splitlines()[-1])))
    return samples


def in_process(device: str, iterations: int, rounds: int) -> Dict[str, List[float]]:
    """``live`` vs ``idle`` (and ``live, in p`` on a device) in this process."""
    import torch_pipeline as tp

    loop = _add_loop(device)

    def idle(n: int) -> None:
        loop(n)

    def live(n: int) -> None:
        p = tp.Pipeline()  # tracking goes live while p is alive
        loop(n)
        del p

    def live_in_p(n: int) -> None:
        p = tp.Pipeline()
        with p:
            loop(n)
        del p

    variants = [Variant(IDLE, idle, iterations), Variant(LIVE, live, iterations)]
    if device != "cpu":
        variants.append(Variant(LIVE_IN_P, live_in_p, iterations))
    return time_rounds(variants, rounds)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--iterations", type=int, default=None,
                        help="ops per round on CPU (default 50000, quick 10000; sim: a tenth)")
    parser.add_argument("--child", choices=[NOT_IMPORTED, IDLE], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    iterations = args.iterations or (10_000 if args.quick else 50_000)
    rounds = args.rounds or (3 if args.quick else 7)
    if args.child:
        child(args.child, iterations, rounds)
        return 0

    print(environment_line())
    print(f"torch.add on 8-element tensors; {rounds} rounds, {iterations} ops per round on CPU")
    ok = True

    print("\n[cpu] torch_pipeline not imported vs imported and idle (separate processes)")
    procs = across_processes(iterations, rounds)
    print_table(procs)
    ok &= check_targets(procs, [Target(IDLE, NOT_IMPORTED, 1.03, "idle <= 1.03x not imported")])

    print("\n[cpu] tracking live vs idle (one process)")
    cpu = in_process("cpu", iterations, rounds)
    print_table(cpu)
    ok &= check_targets(cpu, [Target(LIVE, IDLE, 1.25, "live <= 1.25x idle")])

    import torch_pipeline.sim as sim

    sim.enable(num_devices=1)
    print("\n[sim] tracking live vs idle (one process)")
    sim_samples = in_process("sim:0", max(1, iterations // 10), rounds)
    print_table(sim_samples)
    ok &= check_targets(sim_samples, [Target(LIVE, IDLE, 1.25, "live <= 1.25x idle"),
                                      Target(LIVE_IN_P, IDLE, 1.25, "live, in p <= 1.25x idle")])
    import torch

    if torch.cuda.is_available():
        print("\n[cuda] tracking live vs idle (one process)")
        cuda = in_process("cuda:0", iterations, rounds)
        print_table(cuda)
        ok &= check_targets(cuda, [Target(LIVE, IDLE, 1.25, "live <= 1.25x idle"),
                                   Target(LIVE_IN_P, IDLE, 1.25, "live, in p <= 1.25x idle")])
    return finish(ok, args.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
