"""A picture of one training step, naive vs pipelined, drawn from sim.trace.

Runs a two-branch model's training step (forward, backward, SGD) twice on the asynchronous sim
device, where every kernel takes ``--kernel-us`` on its stream's thread: once on the default
stream only (naive), once with each branch under a pipeline of its own. Each run is recorded with
``torch_pipeline.sim.trace`` (a Chrome / Perfetto trace: ``--traces DIR`` keeps them) and
drawn as one row per stream, kernels as bars and the waits that automatic synchronization
inserted as arrows. Needs matplotlib.

    python examples/timeline.py [--out docs/timeline.png] [--traces DIR] [--kernel-us US]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

import torch_pipeline as tp
import torch_pipeline.sim as sim


class Branch(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def step(left: Branch, right: Branch, opt: torch.optim.Optimizer, x: torch.Tensor,
         pl: Optional[tp.Pipeline], pr: Optional[tp.Pipeline]) -> None:
    with tp.pipeline(pl):
        yl = left(x)
    with tp.pipeline(pr):
        yr = right(x)
    (yl + yr).square().mean().backward()  # each branch's backward runs on its forward's stream
    opt.step()
    opt.zero_grad()


def record(path: str, pipelined: bool, kernel_us: float) -> List[Dict[str, Any]]:
    torch.manual_seed(0)
    left, right = Branch(64).to("sim:0"), Branch(64).to("sim:0")
    opt = torch.optim.SGD(list(left.parameters()) + list(right.parameters()), lr=0.1,
                          foreach=True)
    x = torch.randn(32, 64).to("sim:0")
    pl, pr = (tp.Pipeline(), tp.Pipeline()) if pipelined else (None, None)
    step(left, right, opt, x, pl, pr)  # warm-up (meta plans, streams)
    torch.accelerator.synchronize()
    sim.set_latency(launch_us=kernel_us)
    try:
        with sim.trace(path) as tr:
            step(left, right, opt, x, pl, pr)
    finally:
        sim.set_latency(launch_us=0)
    return tr.events


def rows(events: List[Dict[str, Any]]) -> Tuple[Dict[int, str], float]:
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    end = max((e["ts"] + e.get("dur", 0) for e in events if e["ph"] == "X"), default=0.0)
    return names, end


def draw(ax: Any, events: List[Dict[str, Any]], title: str, span: float) -> None:
    names, _ = rows(events)
    order = sorted(names, key=lambda tid: ("default" not in names[tid], names[tid]))
    y = {tid: len(order) - 1 - i for i, tid in enumerate(order)}
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for e in events:
        if e.get("cat") == "kernel":
            ax.broken_barh([(e["ts"] / 1000, e["dur"] / 1000)], (y[e["tid"]] - 0.35, 0.7),
                           facecolors=colors[y[e["tid"]] % len(colors)], edgecolor="white",
                           linewidth=0.5)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    for e in events:
        if e["ph"] == "f" and e["id"] in starts:
            s = starts[e["id"]]
            if s["tid"] == e["tid"]:
                continue
            ax.annotate("", xy=(e["ts"] / 1000, y[e["tid"]]), xytext=(s["ts"] / 1000, y[s["tid"]]),
                        arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8})
    ax.set_yticks([y[t] for t in order])
    ax.set_yticklabels([names[t].replace(" (exclusive)", "") for t in order], fontsize=8)
    ax.set_xlim(0, span / 1000 * 1.02)
    ax.set_title(title, fontsize=10)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("docs", "timeline.png"))
    parser.add_argument("--traces", default=None,
                        help="folder for the two Chrome traces (default: a temporary folder)")
    parser.add_argument("--kernel-us", type=float, default=1000.0,
                        help="modelled device time of every kernel (default 1000)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("examples/timeline.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    sim.enable(num_devices=1, strict=True, asynchronous=True)
    folder = args.traces or tempfile.mkdtemp(prefix="tp-timeline-")
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, "step")
    naive = record(base + "-naive.json", False, args.kernel_us)
    piped = record(base + "-pipelined.json", True, args.kernel_us)
    span = max(rows(naive)[1], rows(piped)[1])
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True,
                             gridspec_kw={"height_ratios": [1, 3]})
    draw(axes[0], naive, f"naive: one stream ({rows(naive)[1] / 1000:.1f} ms)", span)
    draw(axes[1], piped, f"two pipelines, no manual sync ({rows(piped)[1] / 1000:.1f} ms); "
                         "arrows: waits inserted by torch_pipeline", span)
    axes[1].set_xlabel("ms (modelled device time, sim device, asynchronous mode)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} (and the traces {base}-naive.json, {base}-pipelined.json); "
          f"step: naive {rows(naive)[1] / 1000:.1f} ms, pipelined {rows(piped)[1] / 1000:.1f} ms, "
          f"races {len(sim.races())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
