"""Allocator safety: memory held by record_stream vs holding blocks until their use completes.

A storage allocated on one stream and used on another must not be reused before that use has
completed (docs/design.md, "The rules": allocator safety). torch_pipeline's tracker can do it two
ways (``tp._C._set_allocator_safety``, or TORCH_PIPELINE_ALLOCATOR_SAFETY):

* ``hold`` (default) -- keep a reference to the storage until an event after its use on the
                        other stream has completed (polled every few device launches and after
                        synchronize): the block returns to the pool once the *use* has
                        completed, as ProcessGroupNCCL's tensor stashing does since it dropped
                        record_stream (pytorch/pytorch#150398, for #147168);
* ``record_stream``  -- the caching allocator's record_stream: when the storage is freed the
                        allocator records an event on the using stream and reuses the block once
                        all the work queued there *at free time* has completed.

They differ when the using stream has more work queued after the use than before the free, like a
communication stream with a deep queue. This program runs two workloads both ways on the current
accelerator and prints the peak memory reserved (and allocated) by the caching allocator:

* ``join``        -- two branches on two pipelines joined on the main stream, outputs freed right
                     after the join (the common case: the ways should tie);
* ``deep queue``  -- a tensor produced on the main stream is read on a side pipeline that then
                     has ``--queue-ms`` of other work queued (a comm stream with more buckets
                     behind it); the main stream frees it and allocates the next one.

The memory that counts is what the caching allocator reserves from the device (what runs out);
"allocated" is printed too, but allocators book a block waiting for its record_stream events
differently (CUDA's keeps it allocated, the sim device's does not). On CUDA the device runs behind
the host, so a deep queue on the using stream keeps record_stream's blocks back. On the sim device
a stream's work is complete as soon as the host asks: there the ways differ only by when the
memory is looked at again (the allocator at its next allocation, holding at its next poll).

On the asynchronous sim device (``sim-async``) the queued work is real: kernels with a modelled
duration on the side stream's queue, so the deep-queue case shows without a GPU.

    python bench/bench_allocator.py [--device cuda|sim|sim-async] [--steps N] [--mib N]
                                    [--queue-ms MS] [--depths 1,8,64]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Tuple

import torch

import torch_pipeline as tp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import record  # noqa: E402


def sleep_fn(device: str, ms: float, depth: int = 1) -> Callable[[], None]:
    """``depth`` kernels of ``ms`` / ``depth`` each, queued on the current stream."""
    if device.startswith("sim") and ms > 0:
        import torch_pipeline.sim as sim

        if not sim.is_asynchronous():
            return lambda: None
        sim.set_latency(op="aten::add_.Tensor", us=ms * 1000 / depth)
        buf = torch.zeros(1, device=device)

        def busy() -> None:
            for _ in range(depth):
                buf.add_(1)
        return busy
    if not device.startswith("cuda") or ms <= 0:
        return lambda: None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(ms * 1_000_000 / start.elapsed_time(end))
    per_kernel = max(1, cycles // depth)
    return lambda: [torch.cuda._sleep(per_kernel) for _ in range(depth)] and None


def deep_queue(device: str, steps: int, numel: int, busy: Callable[[], None]) -> None:
    """No manual sync: the tracker orders the side use and keeps x's memory from early reuse."""
    side = tp.Pipeline()
    for _ in range(steps):
        x = torch.ones(numel, device=device)      # main stream
        with tp.pipeline(side):
            x.sum()                               # the side stream's use
            busy()                                # then a deep queue of other work
        del x                                     # freed while the side stream is busy


def join(device: str, steps: int, numel: int, busy: Callable[[], None]) -> None:
    pa, pb = tp.Pipeline(), tp.Pipeline()
    x = torch.ones(numel, device=device)
    for _ in range(steps):
        with tp.pipeline(pa):
            a = x * 2
            busy()
        with tp.pipeline(pb):
            b = x * 3
        y = a + b
        del a, b, y


def peaks_mib(device: str, fn: Callable[[], None]) -> Tuple[float, float]:
    """Peak memory allocated and reserved by the device's caching allocator while fn runs
    (torch.accelerator memory statistics: CUDA's allocator and the sim device's keep them). A
    block kept from reuse counts as allocated both ways (held by us, or waiting for its
    record_stream events in the allocator)."""
    gc.collect()
    index = torch.device(device).index
    torch.accelerator.synchronize(index)
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats(index)
    fn()
    torch.accelerator.synchronize(index)
    return (torch.accelerator.max_memory_allocated(index) / 2**20,
            torch.accelerator.max_memory_reserved(index) / 2**20)


WORKLOADS = {"join": join, "deep queue": deep_queue}
WAYS = ("keep_alive", "record_stream")


def one(kind: str, workload: str, way: str, steps: int, mib: int, queue_ms: float,
        depth: int) -> Tuple[float, float]:
    """One workload one way, in this (fresh) process: its peak allocated and reserved MiB."""
    if kind.startswith("sim"):
        import torch_pipeline.sim as sim

        sim.enable(num_devices=1, asynchronous=kind == "sim-async")
        kind = "sim"
    device = f"{kind}:0"
    numel = mib * 2**20 // 4
    busy = sleep_fn(device, queue_ms, depth)
    tp._C._set_allocator_safety(way)
    fn = WORKLOADS[workload]
    fn(device, 2, numel, busy)  # warm-up (the peaks are reset after it)
    return peaks_mib(device, lambda: fn(device, steps, numel, busy))


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "sim", "sim-async"], default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mib", type=int, default=64, help="size of each tensor (sim: at most 4)")
    parser.add_argument("--queue-ms", type=float, default=20.0)
    parser.add_argument("--depths", default="1,8,64",
                        help="kernels the queued work per step is split into (comma-separated)")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kind = args.device or ("cuda" if torch.cuda.is_available() else "sim")
    if kind.startswith("sim"):
        args.mib = min(args.mib, 4)
    depths = [int(d) for d in args.depths.split(",")]
    if args.one:
        print(json.dumps(one(kind, args.one[0], args.one[1], args.steps, args.mib, args.queue_ms,
                             depths[0])))
        return 0
    # Each (workload, way) in a process of its own: allocators keep what they reserved (the sim
    # device's never gives memory back), so peaks must not carry over.
    print(f"{kind}: {args.steps} steps, {args.mib} MiB tensors, {args.queue_ms:g} ms queued per "
          f"step on the using stream, split into {args.depths} kernels")
    for depth in depths:
        rows: Dict[str, Dict[str, Tuple[float, float]]] = {w: {} for w in WORKLOADS}
        for workload in WORKLOADS:
            for way in WAYS:
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--device", kind, "--steps",
                     str(args.steps), "--mib", str(args.mib), "--queue-ms", str(args.queue_ms),
                     "--depths", str(depth), "--one", workload, way],
                    check=True, capture_output=True, text=True).stdout
                rows[workload][way] = tuple(  # type: ignore[assignment]
                    json.loads(out.strip().splitlines()[-1]))
        print(f"side-queue depth {depth}:")
        for workload, ways in rows.items():
            for way, (allocated, reserved) in ways.items():
                print(f"  {workload:<11} {way:<14} peak reserved {reserved:8.1f} MiB, "
                      f"allocated {allocated:8.1f} MiB")
        for workload in rows:
            ratio = rows[workload]["record_stream"][1] / rows[workload]["keep_alive"][1]
            print(f"  {workload}: record_stream reserves {ratio:.2f}x the memory of keep_alive "
                  f"(peak)")
            record("ratio", numerator=f"{workload}: record_stream peak reserved",
                   denominator="keep_alive peak reserved", ratio=round(ratio, 4), depth=depth)
    if kind == "sim":
        print("(sim: no device lag, so this compares only when memory is looked at again; the "
              "deep-queue case that matters needs a GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
