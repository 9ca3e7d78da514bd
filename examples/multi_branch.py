"""Two independent branches of a model on two pipelines, joined without a single manual sync.

A model whose forward has two independent branches (two towers, an encoder per modality, the
experts of a small mixture) runs them one after the other on one stream, although neither needs
the other. With torch_pipeline each branch runs on a pipeline of its own and the join just uses
both results::

    pa, pb = tp.Pipeline(), tp.Pipeline()
    with tp.pipeline(pa):
        ya = branch_a(x)              # pa's stream waits for x's producer (automatically)
    with tp.pipeline(pb):
        yb = branch_b(x)
    y = ya + yb                       # waits for both branches (automatically)

The hand-written equivalent needs ``wait_stream`` before the branches, ``wait_stream`` before the
join and ``record_stream`` on every tensor that crosses streams (or the caching allocator may hand
its memory out while the other stream still reads it); forgetting any of them is a silent race.

What this program does: builds a model with two branches of ``--depth`` small layers each (the
branches are latency-bound: each kernel is short and occupies a fraction of the GPU, so two
streams can run them side by side; with ``--sleep-us`` each layer also waits on the device for that
long, via ``torch.cuda._sleep``, to stand for latency-bound kernels), and runs its forward

* ``one stream``    -- both branches on the current stream,
* ``hand-written``  -- ``torch.Stream``s with ``wait_stream`` / ``record_stream``,
* ``pipelines``     -- ``tp.pipeline`` contexts, no manual sync,

interleaved in rounds, timing ``--iters`` forwards each, and prints the times and the speed-ups of
the pipelines over one stream (target >= 1.7x for latency-bound branches) and over the
hand-written code (target: within 5%). It checks that all three compute the same output, bit for
bit, and exits with status 1 if not.

On a machine without a GPU it runs on the sim device (docs/design.md, "The sim device") in strict
mode: there it shows that the pipelined forward is race-free (any race would raise) and bit-equal to
one stream; the sim device executes eagerly, so it has no speed-up to show. ``--device sim-async``
runs the sim device asynchronously with every kernel taking ``--sleep-us`` on its stream's thread:
there the speed-ups show without a GPU (still strict).

    python examples/multi_branch.py [--device cuda|sim|sim-async] [--depth N] [--width N] [--batch N]
                                    [--iters N] [--rounds N] [--sleep-us US]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

import torch_pipeline as tp


class Branch(torch.nn.Module):
    def __init__(self, width: int, depth: int, sleep_cycles: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.sleep_cycles = sleep_cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)  # a latency-bound kernel's time on the device
            x = torch.tanh(layer(x))
        return x


class TwoBranchModel(torch.nn.Module):
    def __init__(self, width: int, depth: int, sleep_cycles: int) -> None:
        super().__init__()
        self.a = Branch(width, depth, sleep_cycles)
        self.b = Branch(width, depth, sleep_cycles)

    def one_stream(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)

    def pipelined(self, x: torch.Tensor, pa: tp.Pipeline, pb: tp.Pipeline) -> torch.Tensor:
        with tp.pipeline(pa):
            ya = self.a(x)
        with tp.pipeline(pb):
            yb = self.b(x)
        return ya + yb  # no wait_stream, no record_stream: the tracker inserts what is needed

    def hand_written(self, x: torch.Tensor, sa: torch.Stream, sb: torch.Stream) -> torch.Tensor:
        current = torch.accelerator.current_stream(x.device)
        sa.wait_stream(current)  # x (and the weights) were produced on the current stream
        sb.wait_stream(current)
        with sa:
            ya = self.a(x)
        with sb:
            yb = self.b(x)
        current.wait_stream(sa)
        current.wait_stream(sb)
        x.record_stream(sa)  # x may be freed by the caller while sa and sb still read it
        x.record_stream(sb)
        ya.record_stream(current)  # allocated on sa, freed after use on the current stream
        yb.record_stream(current)
        return ya + yb


def calibrate_sleep(us: float) -> int:
    if us <= 0:
        return 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(us / 1000.0 * 1_000_000 / start.elapsed_time(end))


def time_variants(variants: Dict[str, Callable[[], torch.Tensor]], iters: int, rounds: int,
                  sync: Callable[[], None]) -> Dict[str, float]:
    """Median seconds per forward of each variant, interleaved in rounds."""
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up
        fn()
    sync()
    for r in range(rounds):
        names = list(variants)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                variants[name]()
            sync()
            samples[name].append((time.perf_counter() - t0) / iters)
    return {name: statistics.median(xs) for name, xs in samples.items()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "sim", "sim-async"], default=None,
                        help="default: cuda if available, else sim; sim-async: the sim device run "
                             "asynchronously, each kernel taking --sleep-us (timed like CUDA)")
    parser.add_argument("--depth", type=int, default=16, help="layers per branch")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50, help="forwards per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sleep-us", type=float, default=50.0,
                        help="device time per layer: torch.cuda._sleep on CUDA, the latency "
                             "model's launch time per kernel on sim-async (0: none)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "sim")

    if device.startswith("sim"):
        import torch_pipeline.sim as sim

        sim.enable(num_devices=1, strict=True,  # any race raises sim.RaceError
                   asynchronous=device == "sim-async")
        if device == "sim-async":
            sim.set_latency(launch_us=args.sleep_us)
        dev = torch.device("sim:0")
        sleep_cycles = 0
    else:
        dev = torch.device("cuda:0")
        sleep_cycles = calibrate_sleep(args.sleep_us)

    torch.manual_seed(0)
    model = TwoBranchModel(args.width, args.depth, sleep_cycles).to(dev)
    x = torch.randn(args.batch, args.width, device=dev)
    pa, pb = tp.Pipeline(), tp.Pipeline()

    with torch.no_grad():
        reference = model.one_stream(x)
        piped = model.pipelined(x, pa, pb)
        outputs = {"one stream": reference, "pipelines": piped}
        variants: Dict[str, Callable[[], torch.Tensor]] = {
            "one stream": lambda: model.one_stream(x),
            "pipelines": lambda: model.pipelined(x, pa, pb),
        }
        if device != "sim":
            sa, sb = torch.Stream(device=dev), torch.Stream(device=dev)
            outputs["hand-written"] = model.hand_written(x, sa, sb)
            variants["hand-written"] = lambda: model.hand_written(x, sa, sb)
        for name, out in outputs.items():
            print(f"{name:<13} output checksum {out.double().sum().item():.6f}")
        problems = [name for name, out in outputs.items()
                    if not torch.equal(out.cpu(), reference.cpu())]

        if device == "sim":
            races = sim.races()
            print(f"sim (strict): pipelined forward ran with {len(races)} races; "
                  f"{tp._C._tracking_stats()['waits']} waits inserted by the tracker")
            problems += [str(r) for r in races]
            # The same forward with automatic synchronization switched off (a test-only switch):
            sim.set_strict(False)
            tp._C._set_tracking_enabled(False)
            model.pipelined(x, pa, pb)
            tp._C._set_tracking_enabled(True)
            print(f"without automatic synchronization the same forward has {len(sim.races())} "
                  "races (the joins and the branch inputs)")
        else:
            sync = torch.accelerator.synchronize
            times = time_variants(variants, args.iters, args.rounds, sync)
            print(f"\n{args.depth} layers per branch, width {args.width}, batch {args.batch}, "
                  f"{args.sleep_us:g} us device sleep per layer; median ms per forward:")
            for name, t in times.items():
                print(f"  {name:<13} {t * 1e3:8.3f}")
            over_one = times["one stream"] / times["pipelines"]
            over_hand = times["hand-written"] / times["pipelines"]
            print(f"speed-up over one stream:       {over_one:.2f}x (target >= 1.7x)")
            print(f"speed-up over hand-written code: {over_hand:.2f}x (target >= 0.95x)")

    if problems:
        print("CHECK FAILED: " + "; ".join(problems[:5]))
        return 1
    print("check passed: every variant computed the same output, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
