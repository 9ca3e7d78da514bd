"""Allocator safety: memory held by record_stream vs holding blocks until their use completes.

A storage allocated on one stream and used on another must not be reused before that use has
completed (DESIGN.md §4, "allocator safety"). Two ways to get that:

* ``record_stream``  -- what torch_pipeline's tracker does: at a storage's first use on a stream it
                        calls the caching allocator's record_stream; when the storage is freed the
                        allocator records an event on every such stream and reuses the block once
                        all the work queued there *at free time* has completed.
* ``hold``           -- keep a reference to the storage until an event recorded right after its
                        last use on the other stream has completed (what
                        TORCH_NCCL_AVOID_RECORD_STREAMS=1 does for NCCL): the block returns to the
                        pool once the *use* has completed, polled at every step.

They differ when the using stream has more work queued after the use than before the free, like a
communication stream with a deep queue. This program runs two workloads both ways on the current
accelerator and prints the peak memory reserved by the caching allocator:

* ``join``        -- two branches on two pipelines joined on the main stream, outputs freed right
                     after the join (the common case: the ways should tie);
* ``deep queue``  -- a tensor produced on the main stream is read by a side stream that then has
                     ``--queue-ms`` of unrelated work queued (a comm stream with more buckets
                     behind it); the main stream frees it and allocates the next one.

On CUDA the device runs behind the host, so the numbers are real. On the sim device (no GPU)
every stream is complete as soon as the host asks, so the two ways cannot differ there: the
program then only shows that both run and hold no more than the workload needs.

    python bench/bench_allocator.py [--device cuda|sim] [--steps N] [--mib N] [--queue-ms MS]
"""
from __future__ import annotations

import argparse
import collections
import gc
import sys
from typing import Callable, Deque, Dict, List, Tuple

import torch

import torch_pipeline as tp


def sleep_fn(device: str, ms: float) -> Callable[[], None]:
    if not device.startswith("cuda") or ms <= 0:
        return lambda: None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(ms * 1_000_000 / start.elapsed_time(end))
    return lambda: torch.cuda._sleep(cycles)


def deep_queue_record_stream(device: str, steps: int, numel: int, busy: Callable[[], None]) -> None:
    """The tracker's way: no manual sync; the tracker calls record_stream at the side use."""
    side = tp.Pipeline()
    for _ in range(steps):
        x = torch.ones(numel, device=device)      # main stream
        with tp.pipeline(side):
            x.sum()                               # the side stream's use
            busy()                                # then a deep queue of other work
        del x                                     # freed: reuse waits for the whole queue


def deep_queue_hold(device: str, steps: int, numel: int, busy: Callable[[], None]) -> None:
    """Hand-written streams that hold each block until an event after its use completes."""
    main = torch.accelerator.current_stream()
    side = torch.Stream(device=device)
    held: Deque[Tuple[torch.Tensor, torch.Event]] = collections.deque()
    for _ in range(steps):
        x = torch.ones(numel, device=device)
        side.wait_stream(main)
        with _on_stream(side):
            x.sum()
            used = torch.Event(device=device)
            used.record(side)
            busy()
        held.append((x, used))                    # no record_stream: we hold the reference
        del x
        while held and held[0][1].query():        # release what the device is done with
            held.popleft()
    main.wait_stream(side)
    held.clear()


class _on_stream:
    """Makes `s` the current stream of its device (like torch.cuda.stream, device-generic)."""

    def __init__(self, s: torch.Stream) -> None:
        self.s = s

    def __enter__(self) -> None:
        self.prev = torch.accelerator.current_stream()
        torch.accelerator.set_stream(self.s)

    def __exit__(self, *exc: object) -> None:
        torch.accelerator.set_stream(self.prev)


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


def peak_mib(device: str, fn: Callable[[], None]) -> float:
    """Peak memory reserved by the device's caching allocator while fn runs (torch.accelerator
    memory statistics: CUDA's allocator and the sim device's both keep them)."""
    gc.collect()
    index = torch.device(device).index
    torch.accelerator.synchronize(index)
    if hasattr(torch.accelerator, "empty_cache"):
        torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats(index)
    fn()
    torch.accelerator.synchronize(index)
    return torch.accelerator.max_memory_reserved(index) / 2**20


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "sim"], default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mib", type=int, default=64, help="size of each tensor")
    parser.add_argument("--queue-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    kind = args.device or ("cuda" if torch.cuda.is_available() else "sim")
    if kind == "sim":
        import torch_pipeline.sim as sim

        sim.enable(num_devices=1)
        args.mib = min(args.mib, 4)
    device = f"{kind}:0"
    numel = args.mib * 2**20 // 4
    busy = sleep_fn(device, args.queue_ms)
    rows: Dict[str, Dict[str, float]] = {
        "join": {"record_stream": peak_mib(device, lambda: join(device, args.steps, numel, busy))},
        "deep queue": {
            "record_stream": peak_mib(device, lambda: deep_queue_record_stream(device, args.steps, numel, busy)),
            "hold": peak_mib(device, lambda: deep_queue_hold(device, args.steps, numel, busy)),
        },
    }
    print(f"{kind}: {args.steps} steps, {args.mib} MiB tensors, {args.queue_ms:g} ms queued per step")
    for workload, ways in rows.items():
        for way, mib in ways.items():
            print(f"  {workload:<11} {way:<14} peak reserved {mib:8.1f} MiB")
    ratio = rows["deep queue"]["record_stream"] / rows["deep queue"]["hold"]
    print(f"deep queue: record_stream reserves {ratio:.2f}x the memory of hold")
    if kind == "sim":
        print("(sim: a stream's work is complete as soon as the host asks, so neither way can hold "
              "memory longer than the other here; run on a GPU for the real comparison)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
