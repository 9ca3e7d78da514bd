"""DDP-style gradient all-reduce on a communication pipeline, overlapping the backward pass.

Data-parallel training all-reduces every gradient after backward. Gradients of the last layers
are ready long before backward ends, so DDP all-reduces them in buckets while backward continues.
With torch_pipeline that is a few lines of plain torch.distributed: a gradient hook hands each full
bucket to a pipeline on worker thread 1, whose task all-reduces it inside ``tp.collective()`` (the
worker thread's communication stream on GPUs) on the worker thread's own process group::

    groups = tpd.thread_groups()                 # one process group per worker thread
    comm = tp.Pipeline(tp.get_worker_thread(1))

    def reduce_bucket(flat):                      # runs on worker thread 1
        with tp.collective():
            dist.all_reduce(flat, group=groups.current())
        return flat.div_(world)

    # in a post-accumulate-grad hook, when a bucket is full:
    futures[i] = comm.submit(reduce_bucket, torch.cat([p.grad.flatten() for p in bucket]))

No stream is synchronized by hand: the comm stream waits for the gradients, and the copies back
wait for the all-reduce (automatic synchronization).

What this program does: trains the same MLP for ``--steps`` steps twice (same seed, same data),
first all-reducing every bucket after backward on the main thread ("no overlap"), then through
the comm pipeline during backward ("overlap"); prints the median step time of each and the
speed-up, and checks that both runs end with the same parameters, bit for bit, on every rank.

    torchrun --nproc_per_node=2 examples/overlap_allreduce.py [--device cpu|cuda] [--steps N]
    python examples/overlap_allreduce.py [...]     # without torchrun: spawns 2 ranks itself

On the CPU it uses Gloo (each rank computes with ``--threads`` intra-op threads, default 1), on
GPUs NCCL (one GPU per rank).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import torch_pipeline as tp
import torch_pipeline.distributed as tpd


def make_model(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).to(device)


def buckets_of(model: torch.nn.Module, bucket_mb: float) -> List[List[torch.nn.Parameter]]:
    """Parameters in reverse order (the order backward produces their gradients), in buckets."""
    buckets: List[List[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(list(model.parameters())):
        if size >= bucket_mb * 2**20 and buckets[-1]:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


def copy_back(bucket: List[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in bucket:
        n = p.numel()
        assert p.grad is not None
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def train(args: argparse.Namespace, device: torch.device, overlap: bool) -> tuple:
    world = dist.get_world_size()
    model = make_model(args.width, args.depth, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buckets = buckets_of(model, args.bucket_mb)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [(torch.randn(args.batch, args.width, generator=g).to(device),
             torch.randint(0, 10, (args.batch,), generator=g).to(device)) for _ in range(4)]

    comm = tp.Pipeline(tp.get_worker_thread(1)) if overlap else None
    groups = tpd.thread_groups() if overlap else None
    futures: Dict[int, torch.futures.Future] = {}  # bucket index -> its all-reduce
    pending = {id(p): i for i, b in enumerate(buckets) for p in b}
    ready = [0] * len(buckets)

    def reduce_bucket(flat: torch.Tensor) -> torch.Tensor:
        assert groups is not None
        with tp.collective():
            dist.all_reduce(flat, group=groups.current())
        return flat.div_(world)

    def on_grad(p: torch.nn.Parameter) -> None:
        i = pending[id(p)]
        ready[i] += 1
        if ready[i] == len(buckets[i]):
            assert comm is not None
            flat = torch.cat([q.grad.flatten() for q in buckets[i]])
            futures[i] = comm.submit(reduce_bucket, flat)  # returns at once

    handles = []
    if overlap:
        handles = [p.register_post_accumulate_grad_hook(on_grad) for p in model.parameters()]

    times = []
    for step in range(args.steps):
        x, y = data[step % len(data)]
        sync(device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if overlap:
            for i, bucket in enumerate(buckets):
                copy_back(bucket, futures[i].wait())
            futures.clear()
            ready[:] = [0] * len(buckets)
        else:
            for bucket in buckets:
                flat = torch.cat([p.grad.flatten() for p in bucket])
                dist.all_reduce(flat)
                copy_back(bucket, flat.div_(world))
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync(device)
        times.append(time.perf_counter() - t0)
    for h in handles:
        h.remove()
    params = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return statistics.median(times[1:] or times), params


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_main(args: argparse.Namespace) -> int:
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain_s, plain = train(args, device, overlap=False)
    overlap_s, overlapped = train(args, device, overlap=True)
    same = torch.equal(plain, overlapped)
    all_same: List[Optional[bool]] = [None] * world
    dist.all_gather_object(all_same, same)
    if rank == 0:
        print(f"{world} ranks on {device.type} ({dist.get_backend()}), {args.depth} layers of "
              f"{args.width}, buckets of {args.bucket_mb:g} MiB, {args.steps} steps")
        print(f"no overlap  {plain_s * 1e3:8.2f} ms per step (all-reduce after backward)")
        print(f"overlap     {overlap_s * 1e3:8.2f} ms per step (all-reduce on a comm pipeline "
              "during backward)")
        print(f"speed-up: {plain_s / overlap_s:.2f}x")
        print("check passed: both runs ended with the same parameters on every rank"
              if all(all_same) else f"CHECK FAILED: parameters differ (per rank: {all_same})")
    dist.destroy_process_group()
    return 0 if all(all_same) else 1


def spawn(argv: List[str], world: int) -> int:
    """Without torchrun: start `world` ranks of this program on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    return max(p.wait() for p in procs)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        return spawn(argv, args.nproc)
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
