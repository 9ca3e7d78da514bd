"""The overlap helpers (tp.prefetch, tp.item_async, tp.offload) against what users write without them.

Rows, each side by side in one process (see _harness.py):

* prefetch: a training step of a small model fed 2 MiB batches by ``tp.prefetch(batches,
  device)`` vs the synchronous ``batch.to(device)`` loop;
* item_async: a step that logs its loss with ``tp.item_async`` vs ``loss.item()`` vs no logging;
* offload: a step of a narrow model on a large batch (activations outweigh the parameters) under
  ``tp.offload`` vs keeping activations vs ``save_on_cpu``, and the peak device memory of each.

On the sim device in its default (synchronous) mode every copy and read completes at once, so the
``sim`` rows show the helpers' own cost, not the overlap they buy. ``sim-async`` runs the sim device
asynchronously with a latency model (every kernel and copy takes at least 300 us plus its bytes at
2 GB/s on its stream's thread), so host stalls and overlap show as on a GPU; ``cuda`` is the real
thing (run by scripts/gpu_check.sh).

    python bench/bench_overlap.py [--device sim|sim-async|cuda] [--quick]
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List

from _harness import (Target, Variant, add_common_args, check_targets, environment_line, finish,
                      print_table, time_rounds)


def _setup(device: str):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [(torch.randn(128, 256), torch.randint(0, 10, (128,))) for _ in range(8)]
    return model, opt, batches


def prefetch_rows(device: str, rounds: int, steps: int) -> Dict[str, List[float]]:
    import torch
    import torch.nn.functional as F
    import torch_pipeline as tp

    # Input-heavy, as data loading is when it matters: 2 MiB batches into a small model.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8192, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    pinned = [(torch.randn(64, 8192).pin_memory(), torch.randint(0, 10, (64,)).pin_memory())
              for _ in range(4)]

    def step(x: "torch.Tensor", y: "torch.Tensor") -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def synchronous(n: int) -> None:
        for i in range(n):
            x, y = pinned[i % len(pinned)]
            step(x.to(device), y.to(device))
        tp.synchronize()

    def prefetched(n: int) -> None:
        for x, y in tp.prefetch((pinned[i % len(pinned)] for i in range(n)), device, depth=2):
            step(x, y)
        tp.synchronize()

    return time_rounds([Variant("batch.to(device)", synchronous, steps),
                        Variant("tp.prefetch", prefetched, steps)], rounds)


def item_async_rows(device: str, rounds: int, steps: int) -> Dict[str, List[float]]:
    import torch.nn.functional as F
    import torch_pipeline as tp

    model, opt, batches = _setup(device)
    on_device = [(x.to(device), y.to(device)) for x, y in batches]
    logged: List[object] = []

    def run(log: Callable[[object], None]) -> Callable[[int], None]:
        def steps_(n: int) -> None:
            for i in range(n):
                x, y = on_device[i % len(on_device)]
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                log(loss)
            tp.synchronize()
            logged.clear()
        return steps_

    return time_rounds([Variant("no logging", run(lambda loss: None), steps),
                        Variant("loss.item()", run(lambda loss: logged.append(loss.item())), steps),
                        Variant("tp.item_async", run(lambda loss: logged.append(
                            tp.item_async(loss))), steps)], rounds)


def offload_rows(device: str, rounds: int, steps: int) -> Dict[str, List[float]]:
    import torch
    import torch.nn.functional as F
    import torch_pipeline as tp

    # Activation-heavy, as where offload matters: a large batch through narrow layers.
    torch.manual_seed(0)
    hidden = [m for _ in range(6) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), *hidden,
                                torch.nn.Linear(512, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    on_device = [(torch.randn(2048, 256).to(device), torch.randint(0, 10, (2048,)).to(device))
                 for _ in range(2)]
    peaks: Dict[str, int] = {}

    def run(name: str, ctx: Callable[[], object]) -> Callable[[int], None]:
        def steps_(n: int) -> None:
            index = torch.device(device).index
            tp.synchronize()
            torch.accelerator.reset_peak_memory_stats(index)
            for i in range(n):
                x, y = on_device[i % len(on_device)]
                with ctx():  # type: ignore[attr-defined]
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            tp.synchronize()
            peaks[name] = max(peaks.get(name, 0), torch.accelerator.max_memory_allocated(index))
        return steps_

    import contextlib

    samples = time_rounds([
        Variant("keep activations", run("keep activations", contextlib.nullcontext), steps),
        Variant("save_on_cpu", run("save_on_cpu", lambda: torch.autograd.graph.save_on_cpu(
            pin_memory=True)), steps),
        Variant("tp.offload", run("tp.offload", lambda: tp.offload(min_bytes=1 << 16)), steps),
        Variant("tp.offload, prefetch 2", run("tp.offload, prefetch 2", lambda: tp.offload(
            min_bytes=1 << 16, prefetch=2)), steps),
        Variant("tp.offload, 8 MiB in flight", run("tp.offload, 8 MiB in flight", lambda: tp.offload(
            min_bytes=1 << 16, max_in_flight=8 << 20)), steps),
    ], rounds)
    for name, peak in peaks.items():
        print(f"  peak device memory, {name}: {peak / 2**20:.1f} MiB")
    return samples


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", choices=["sim", "sim-async", "cuda"], default="sim")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    steps = 4 if args.quick else 16
    if args.device.startswith("sim"):
        import torch_pipeline.sim as sim

        sim.enable(num_devices=2, asynchronous=args.device == "sim-async")
        if args.device == "sim-async":
            sim.set_latency(launch_us=300, bandwidth_gbps=2)
        device = "sim:0"
    else:
        device = "cuda:0"
    print(environment_line())
    print(f"device {device}; {rounds} rounds of {steps} training steps (MLP 256-1024-1024-10)")
    ok = True

    overlapping = args.device != "sim"
    sections = [
        ("prefetch", prefetch_rows, Target("tp.prefetch", "batch.to(device)", 1.0,
                                           "prefetch no slower than the synchronous loop")),
        ("item_async", item_async_rows, Target("tp.item_async", "no logging", 1.05,
                                               "logging with item_async within 5% of no logging")),
        ("offload", offload_rows, Target("tp.offload", "save_on_cpu", 1.0,
                                         "offload no slower than save_on_cpu")),
    ]
    for name, rows, target in sections:
        print(f"\n[{name}] ns per step")
        samples = rows(device, rounds, steps)
        print_table(samples)
        if overlapping:
            ok &= check_targets(samples, [target])
    if not overlapping:
        print("(sim, synchronous mode: these rows are the helpers' own cost; see the docstring)")
    return finish(ok, args.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
