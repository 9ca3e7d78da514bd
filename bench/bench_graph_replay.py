"""The tracker's cost of ordering a graph replay (docs/design.md, "Graph capture"), on the sim
device's capture twin.

A graph is captured inside a pipeline that reads ``--params`` parameter storages (made before
the capture, so the graph keeps them for its lifetime) and writes one output. Each replay is one
op on the replaying stream that reads and writes what the graph touched (``GraphReplay``). Three
variants, interleaved (see _harness.py), per replay:

* ``replay_tracked``: ``g.replay()`` inside a pipeline, tracking live (the ordered replay);
* ``replay_untracked``: the twin's own replay (``sim.Graph``'s captured graph, replayed without
  the hooks: what a replay costs with nothing to order);
* ``op_tracked``: one ordinary tracked op (``out.add_(1)``) inside the pipeline, for scale.

The number to watch is ``replay_tracked - replay_untracked``: the tracker's per-replay cost.

    python bench/bench_graph_replay.py [--quick] [--params N]
"""
from __future__ import annotations

import argparse
import sys
from typing import List

import torch

import torch_pipeline as tp
import torch_pipeline.sim as sim

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _harness import Variant, add_common_args, environment_line, print_table, time_rounds  # noqa: E402


def variants(params: int, iterations: int) -> List[Variant]:
    p = tp.Pipeline()
    weights = [torch.full((16,), float(i), device="sim:0") for i in range(params)]
    out = torch.zeros(16, device="sim:0")
    g = sim.Graph()
    with tp.pipeline(p):
        with sim.graph(g):
            acc = torch.zeros(16, device="sim:0")
            for w in weights:
                acc.add_(w)
            out.copy_(acc)

    def replay_tracked(n: int) -> None:
        with tp.pipeline(p):
            for _ in range(n):
                g.replay()

    raw = g._graph  # (the twin's graph: its replay is not a dispatcher op, so not observed)

    def replay_untracked(n: int) -> None:
        stream = torch.accelerator.current_stream()
        for _ in range(n):
            raw.replay(stream)

    def op_tracked(n: int) -> None:
        with tp.pipeline(p):
            for _ in range(n):
                out.add_(1)

    variants.keep = (p, weights, out, g)  # type: ignore[attr-defined]
    return [Variant("replay_tracked", replay_tracked, iterations),
            Variant("replay_untracked", replay_untracked, iterations),
            Variant("op_tracked", op_tracked, iterations)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--params", type=int, default=200, help="parameter storages (default 200)")
    args = parser.parse_args()
    sim.enable(num_devices=1, strict=False)
    rounds = args.rounds or (3 if args.quick else 7)
    iterations = 100 if args.quick else 400
    print(environment_line())
    print(f"graph over {args.params} parameter storages, {iterations} replays a round")
    vs = variants(args.params, iterations)
    samples = time_rounds(vs, rounds)
    print_table(samples, unit="us", scale=1000.0)
    from _harness import median

    extra = median(samples["replay_tracked"]) - median(samples["replay_untracked"])
    print(f"tracker cost per replay: {extra / 1000.0:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
