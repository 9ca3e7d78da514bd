"""Compiled code and CUDA graphs under pipelines, next to the same code on the default pipeline
(docs/design.md, "Compiled regions" and "Graph capture").

What is measured, in one process, variants interleaved in rounds (``_harness.time_rounds``):

* ``[compile]`` -- a training step of a small MLP compiled with ``torch.compile`` (Inductor: C++
  kernels on the CPU, Triton on a GPU): two micro-batches, each forward in its own pipeline
  (``two pipelines``), then backward and SGD; against the same compiled step with every pipeline
  the default one (``default pipeline``). Each compiled call is one tracked region (its arguments
  read and written, its outputs fresh). Target: two pipelines <= 1.05x the default pipeline.
* ``[graph]`` (CUDA only) -- a captured ``torch.cuda.CUDAGraph`` of the MLP's forward replayed
  inside ``with tp.pipeline(p):`` (each replay ordered as one op on p's stream) against the same
  replays outside any pipeline. Target: inside <= 1.02x outside.

Milliseconds per step (or per replay). The exit status is 0 unless ``--check`` is given and a target
is missed. ``--quick`` runs fewer rounds and steps. ``--device`` picks ``cpu`` (default) or ``cuda``.

    python bench/bench_compile.py [--quick] [--check] [--rounds N] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import (  # noqa: E402
    Target,
    Variant,
    add_common_args,
    check_targets,
    environment_line,
    finish,
    print_table,
    record,
    time_rounds,
)


def _mlp(device: str):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10)).to(device)


def compile_rows(device: str, rounds: int, steps: int) -> Dict[str, List[float]]:
    """``default pipeline`` vs ``two pipelines``: ns per compiled training step (also prints how
    many compiled regions the pipelined steps tracked: none would mean the row measured nothing)."""
    import torch
    import torch_pipeline as tp

    model = _mlp(device)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 256, generator=g).to(device) for _ in range(2)]
    ys = [torch.randint(0, 10, (64,), generator=g).to(device) for _ in range(2)]

    def step(p0: Optional[tp.Pipeline], p1: Optional[tp.Pipeline]) -> None:
        losses = []
        for p, x, y in ((p0, xs[0], ys[0]), (p1, xs[1], ys[1])):
            with tp.pipeline(p):
                losses.append(torch.nn.functional.cross_entropy(compiled(x), y))
        (losses[0] + losses[1]).backward()
        opt.step()
        opt.zero_grad()

    def default(n: int) -> None:
        for _ in range(n):
            step(None, None)

    def pipelined(n: int) -> None:
        p0, p1 = tp.Pipeline(), tp.Pipeline(tp.get_worker_thread(1))
        for _ in range(n):
            step(p0, p1)
        del p0, p1

    step(None, None)  # compile outside the timed rounds (forward and backward graphs)
    before = tp.tracking_stats()["compiled_regions"]
    rows = time_rounds([Variant("default pipeline", default, steps),
                        Variant("two pipelines", pipelined, steps)], rounds)
    regions = tp.tracking_stats()["compiled_regions"] - before
    print(f"compiled regions tracked in the pipelined steps: {regions}")
    if regions == 0:
        raise SystemExit("no compiled region was tracked: the two-pipeline row measured nothing")
    return rows


def graph_rows(rounds: int, replays: int) -> Dict[str, List[float]]:
    """``outside`` vs ``inside p``: ns per replay of a captured forward (CUDA only)."""
    import torch
    import torch_pipeline as tp

    model = _mlp("cuda")
    static_x = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)  # warm up on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        model(static_x)
    p = tp.Pipeline()

    def outside(n: int) -> None:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()

    def inside(n: int) -> None:
        with tp.pipeline(p):
            for _ in range(n):
                graph.replay()
        torch.cuda.synchronize()

    try:
        return time_rounds([Variant("outside", outside, replays),
                            Variant("inside p", inside, replays)], rounds)
    finally:
        del p


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    print(environment_line())
    ok = True

    print(f"\n[compile] compiled MLP training step on {args.device}, two micro-batches "
          "(ms per step)")
    if args.device == "cuda" and importlib.util.find_spec("triton") is None:
        print("SKIP  no triton in this environment: Inductor cannot compile for CUDA")
        record("skip", label="[compile] rows", reason="no triton: Inductor cannot compile for CUDA")
    else:
        rows = compile_rows(args.device, rounds, 5 if args.quick else 20)
        print_table(rows, unit="ms", scale=1e6)
        ok &= check_targets(rows, [Target("two pipelines", "default pipeline", 1.05,
                                          "compiled step in two pipelines <= 1.05x the default "
                                          "pipeline")])

    if args.device == "cuda":
        print("\n[graph] captured forward, replays inside a pipeline vs outside (us per replay)")
        rows = graph_rows(rounds, 50 if args.quick else 500)
        print_table(rows, unit="us", scale=1e3)
        ok &= check_targets(rows, [Target("inside p", "outside", 1.02,
                                          "replay inside a pipeline <= 1.02x outside")])
    return finish(ok, args.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
