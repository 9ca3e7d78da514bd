"""Data-parallel training with pipelines across nodes: the torchrun multi-node recipe.

Every rank (one process per device, on any number of nodes) runs the same program:

* **Pipelines for the model.** The model is two stages; each step splits the rank's batch into
  micro-batches and runs stage 0 of every micro-batch in pipeline ``stage[0]`` and stage 1 in
  pipeline ``stage[1]`` (GPipe-style: on a GPU micro-batch *m*'s stage 1 can run while
  micro-batch *m+1*'s stage 0 does); backward runs per micro-batch, in reverse order.
* **A process group per worker thread.** ``tpd.thread_groups()`` creates one process group per
  worker thread, the same on every rank. The gradient all-reduce runs as a task on a pipeline of
  worker thread 1 (``comm``) inside ``tp.collective()``, on worker thread 1's group; the loss,
  averaged over the ranks for the log, is all-reduced meanwhile by a task on worker thread 2's
  pipeline (``logger``), on worker thread 2's group. Two threads issue collectives at the same
  time, each on its own group, so they cannot pair up differently on different ranks.
* **No hand-written synchronization.** The comm stream waits for the gradients, and the copies
  back into the parameters' gradients wait for the all-reduce (automatic synchronization).

On GPUs it uses NCCL (``--device cuda``, the default when CUDA is available: one GPU per rank,
``LOCAL_RANK``'s). Without one it uses Gloo, and the model runs on the ``sim`` device (strict
race checking: an unordered access raises), with the gradients staged through the host for Gloo,
which takes CPU tensors only; ``--device cpu`` runs it on the CPU.

Two nodes (run the same command on each, with ``HOST`` the address of node 0; ``N`` ranks per
node, e.g. its GPU count)::

    torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id job1 examples/torchrun_nodes.py --out /tmp/run

Two node processes on one machine (Gloo, loopback; start both, e.g. in two shells)::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --rdzv-id demo --rdzv-conf is_host=1 --local-addr 127.0.0.1 examples/torchrun_nodes.py
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --rdzv-id demo --rdzv-conf is_host=0 --local-addr 127.0.0.1 examples/torchrun_nodes.py

What it prints (rank 0): the final loss (averaged over the ranks; every step's with
``--verbose``) and a SHA-256 of the final parameters, checked equal on every rank. With
``--out DIR`` every rank saves ``DIR/rank{RANK}.pt``: its parameters, losses, where it ran, and
what ``TORCH_PIPELINE_DEBUG_COLLECTIVES=1`` found (a process group used from two threads).
``python examples/torchrun_nodes.py --reference --world 2`` computes the same training in one
process with no pipelines and no torch.distributed (each rank's gradients in turn, summed): with
Gloo and 2 ranks its parameters are bit-equal to the distributed run's, on one node or two
(``tests/python/test_torchrun_nodes.py``; with more ranks the sum's order is the backend's).
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import os
import socket
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import torch_pipeline as tp
import torch_pipeline.distributed as tpd

Batch = Tuple[torch.Tensor, torch.Tensor]


def make_stages(width: int, device: torch.device) -> List[torch.nn.Module]:
    """The model, in two stages; the same initial parameters on every rank (seed 0)."""
    torch.manual_seed(0)
    stage0 = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(),
                                 torch.nn.Linear(width, width), torch.nn.Tanh())
    stage1 = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                 torch.nn.Linear(width, 4))
    return [stage0.to(device), stage1.to(device)]


def batches(rank: int, steps: int, batch: int) -> List[Batch]:
    """Rank `rank`'s shard of the data: its own generator, so it depends only on the rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 4, generator=g))
            for _ in range(steps)]


def forward_backward(stages: Sequence[torch.nn.Module], data: Batch, micro: int,
                     device: torch.device,
                     pipelines: Optional[Sequence[tp.Pipeline]] = None) -> torch.Tensor:
    """Forward of every micro-batch (stage i in pipeline i when given), then backward of each in
    reverse order; gradients accumulate in the parameters. Returns the batch's loss."""
    x, y = data[0].to(device), data[1].to(device)
    losses = []
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        h = xm
        for i, stage in enumerate(stages):
            with tp.pipeline(pipelines[i] if pipelines else None):
                h = stage(h)
        with tp.pipeline(pipelines[-1] if pipelines else None):
            losses.append((h - ym).pow(2).mean() / micro)
    for loss in reversed(losses):
        loss.backward()
    return torch.stack([loss.detach() for loss in losses]).sum()


def parameters(stages: Sequence[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for stage in stages for p in stage.parameters()]


def flat_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]


def set_grads(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n


def make_optimizer(params: Sequence[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter kernels on every device type (bit-equal runs).
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)


def checksum(params: Sequence[torch.Tensor]) -> str:
    flat = torch.cat([p.detach().flatten().cpu() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def train(args: argparse.Namespace, device: torch.device) -> Tuple[List[torch.Tensor], List[float]]:
    """This rank's part of the data-parallel training (torch.distributed initialized)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = make_stages(args.width, device)
    params = parameters(stages)
    opt = make_optimizer(params, args.lr)
    data = batches(rank, args.steps, args.batch)

    groups = tpd.thread_groups()                    # collective: every rank, same point
    stage = [tp.Pipeline(), tp.Pipeline()]          # the model's two stages (worker thread 0)
    comm = tp.Pipeline(tp.get_worker_thread(1))     # gradient all-reduce
    logger = tp.Pipeline(tp.get_worker_thread(2))   # loss all-reduce, for the log
    host_staged = dist.get_backend() == "gloo" and device.type != "cpu"

    def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
        """Runs on a worker thread: all-reduces `t` on that thread's own group, averaged."""
        with tp.collective():                       # the worker thread's comm stream
            buf = t.cpu() if host_staged else t     # Gloo takes host tensors only
            dist.all_reduce(buf, group=groups.current())
            buf.div_(world)
            return t.copy_(buf) if host_staged else buf

    losses: List[float] = []
    for step in range(args.steps):
        loss = forward_backward(stages, data[step], args.micro, device, stage)
        logged = logger.submit(all_reduce_mean, loss)           # worker thread 2, its group
        reduced = comm.submit(all_reduce_mean, flat_grads(params))  # worker thread 1, its group
        set_grads(params, reduced.wait())
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(logged.wait().item())
        if rank == 0 and args.verbose:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    tp.synchronize()
    return [p.detach().cpu().clone() for p in params], losses


def reference(args: argparse.Namespace) -> Tuple[List[torch.Tensor], List[float]]:
    """The same training in one process, on the CPU, without pipelines or torch.distributed:
    each rank's gradients in turn, summed in rank order and divided by the world size."""
    stages = make_stages(args.width, torch.device("cpu"))
    params = parameters(stages)
    opt = make_optimizer(params, args.lr)
    data = [batches(r, args.steps, args.batch) for r in range(args.world)]
    losses: List[float] = []
    for step in range(args.steps):
        total: Optional[torch.Tensor] = None
        loss_sum: Optional[torch.Tensor] = None
        for r in range(args.world):
            opt.zero_grad(set_to_none=False)
            loss = forward_backward(stages, data[r][step], args.micro, torch.device("cpu"))
            g = flat_grads(params).clone()
            total = g if total is None else total + g
            loss_sum = loss if loss_sum is None else loss_sum + loss
        assert total is not None and loss_sum is not None
        set_grads(params, total.div_(args.world))
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss_sum.div_(args.world).item())
    return [p.detach().clone() for p in params], losses


def pick_device(args: argparse.Namespace) -> Tuple[torch.device, str]:
    choice = args.device or ("cuda" if torch.cuda.is_available() else "sim")
    if choice == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    if choice == "sim":
        import torch_pipeline.sim as sim
        # Strict: an unordered access raises. Before the first backward of the process.
        sim.enable(num_devices=1, strict=True, asynchronous=args.sim_async)
        return torch.device("sim", 0), "gloo"
    return torch.device("cpu"), "gloo"


def save(out: Optional[str], name: str, result: Dict[str, object]) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        torch.save(result, os.path.join(out, name))


def rank_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    device, backend = pick_device(args)
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    params, losses = train(args, device)
    digest = checksum(params)
    digests: List[Optional[str]] = [None] * world
    dist.all_gather_object(digests, digest)
    ok = all(d == digest for d in digests)
    save(args.out, f"rank{rank}.pt", {
        "params": params, "losses": losses, "checksum": digest, "rank": rank, "world": world,
        "initial_checksum": checksum(parameters(make_stages(args.width, torch.device("cpu")))),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "host": socket.gethostname(), "pid": os.getpid(), "device": str(device),
        "backend": backend, "hazards": tpd.hazards()})
    if rank == 0:
        print(f"{world} ranks on {os.environ.get('GROUP_WORLD_SIZE', '1')} node(s), "
              f"{device.type} ({backend}), {args.steps} steps of {args.micro} micro-batches")
        print(f"final loss {losses[-1]:.6f}")
        print(f"checksum {digest}" if ok else f"CHECK FAILED: ranks differ: {digests}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def leave(code: int) -> None:
    """Exits without interpreter finalization. Gloo's threads drop finished Work objects after
    their waiter moved on; one dropped while the interpreter finalizes takes the GIL inside a
    noexcept destructor and aborts the process (pytorch/pytorch#179291; see
    tests/python/_dist_ranks.py). The exit handlers still run, with the interpreter alive."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "sim", "cpu"], default=None,
                        help="default: cuda when available (NCCL), else sim (Gloo)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--sim-async", action="store_true",
                        help="asynchronous sim (a stream per thread: a missing wait gives wrong "
                        "values)")
    parser.add_argument("--out", default=None, help="directory for each rank's rank{RANK}.pt")
    parser.add_argument("--verbose", action="store_true", help="print every step's loss")
    parser.add_argument("--reference", action="store_true",
                        help="one process, no pipelines, no torch.distributed (see the docstring)")
    parser.add_argument("--world", type=int, default=2, help="ranks the reference stands for")
    args = parser.parse_args(argv)
    if args.reference:
        torch.set_num_threads(args.threads)
        params, losses = reference(args)
        save(args.out, "reference.pt", {"params": params, "losses": losses,
                                        "checksum": checksum(params), "world": args.world})
        print(f"reference of {args.world} ranks: final loss {losses[-1]:.6f}")
        print(f"checksum {checksum(params)}")
        return 0
    if "RANK" not in os.environ:
        parser.error("run it under torchrun (see the docstring), or with --reference")
    return rank_main(args)


if __name__ == "__main__":
    leave(main())
