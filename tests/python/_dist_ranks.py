"""What each rank runs in test_distributed.py (a process per rank, Gloo on loopback).

    python tests/python/_dist_ranks.py PROGRAM RANK WORLD PORT OUT_JSON
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import torch_pipeline as tp
import torch_pipeline.distributed as tpd


def two_worker_threads(rank: int, world: int) -> Dict[str, Any]:
    """Tasks on worker threads 1 and 2 all-reduce, each on its own thread group, 120 iterations
    (worker thread 2 every other time with async_op=True and work.wait()), while the main thread
    computes. Every result is checked exactly."""
    groups = tpd.thread_groups()
    names = [g.group_name for g in groups]
    members = [dist.get_process_group_ranks(g) for g in groups]
    everyone = [None] * world
    dist.all_gather_object(everyone, (names, members))
    same_order = all(e == (names, members) for e in everyone)

    p1 = tp.Pipeline(tp.get_worker_thread(1))
    p2 = tp.Pipeline(tp.get_worker_thread(2))

    def reduce(t: torch.Tensor) -> torch.Tensor:
        with tp.collective():
            dist.all_reduce(t, group=groups.current())
        return t

    def reduce_async(t: torch.Tensor) -> torch.Tensor:
        with tp.collective():
            work = dist.all_reduce(t, group=groups.current(), async_op=True)
        work.wait()  # (hooked: tells automatic synchronization the result is ready here)
        return t

    iterations = 120
    wrong = 0
    main_work = torch.randn(64, 64)
    for i in range(iterations):
        a = torch.full((1000,), float(rank + i))        # sum over ranks: world * i + sum(ranks)
        b = torch.arange(1000, dtype=torch.float64) * (rank + 1)
        fa = p1.submit(reduce, a)
        fb = p2.submit(reduce_async if i % 2 else reduce, b)
        for _ in range(3):
            main_work = torch.tanh(main_work @ main_work)  # the main thread computes meanwhile
        ra, rb = fa.wait(), fb.wait()
        expect_a = float(world * i + world * (world - 1) // 2)
        expect_b = torch.arange(1000, dtype=torch.float64) * (world * (world + 1) // 2)
        wrong += int(not torch.equal(ra, torch.full((1000,), expect_a)))
        wrong += int(not torch.equal(rb, expect_b))
    return {"iterations": iterations, "wrong": wrong, "same_order": same_order,
            "groups": len(groups), "hazards": tpd.hazards()}


def shared_group(rank: int, world: int) -> Dict[str, Any]:
    """Debug mode: tasks of two worker threads issuing on one group are reported; on their own
    thread groups they are not."""
    tpd.set_debug(True)
    groups = tpd.thread_groups()
    p1 = tp.Pipeline(tp.get_worker_thread(1))
    p2 = tp.Pipeline(tp.get_worker_thread(2))

    def reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    for _ in range(3):
        p1.submit(reduce, torch.ones(4), groups[1]).wait()
        p2.submit(reduce, torch.ones(4), groups[2]).wait()
    clean = tpd.hazards()
    p1.submit(reduce, torch.ones(4), None).wait()   # the default group, from worker thread 1
    p2.submit(reduce, torch.ones(4), None).wait()   # ... and from worker thread 2
    return {"clean": clean, "hazards": tpd.hazards()}


def ddp_in_pipelines(rank: int, world: int) -> Dict[str, Any]:
    """DDP training (Gloo) with the forward inside a pipeline context and a logging pipeline on
    worker thread 1 reading each step's loss, against the same training without pipelines: the
    parameters must be bit-equal between the two runs and across ranks."""
    def train(use_pipelines: bool) -> List[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        p = tp.Pipeline() if use_pipelines else None
        logger = tp.Pipeline(tp.get_worker_thread(1)) if use_pipelines else None
        g = torch.Generator().manual_seed(rank)
        logged: List[float] = []
        for step in range(20):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with tp.pipeline(p):
                loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if logger is not None:
                logger.submit(lambda v: logged.append(v.item()), loss.detach())
        if logger is not None:
            logger.synchronize()
            assert len(logged) == 20
        return [q.detach().clone() for q in model.parameters()]

    plain = train(False)
    piped = train(True)
    equal = all(torch.equal(a, b) for a, b in zip(plain, piped))
    flat = torch.cat([q.flatten() for q in piped])
    everyone = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    same_across_ranks = all(torch.equal(e, flat) for e in everyone)
    return {"equal": equal, "same_across_ranks": same_across_ranks}


PROGRAMS: Dict[str, Callable[[int, int], Dict[str, Any]]] = {
    "ddp_in_pipelines": ddp_in_pipelines,
    "two_worker_threads": two_worker_threads,
    "shared_group": shared_group,
}


def main() -> None:
    program, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t0 = time.perf_counter()
    result = PROGRAMS[program](rank, world)
    result["seconds"] = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
    # Leave without interpreter finalization. Gloo's threads drop their finished Work objects
    # after the waiter has moved on; one dropped while the interpreter finalizes decrefs its
    # tensors' Python objects, takes the GIL, is ended by Python inside a noexcept destructor and
    # aborts the process ("terminate called without an active exception", AsyncAllgatherWork's
    # destructor on a ProcessGroupGloo::runLoop thread: a PyTorch hazard of plain Gloo programs,
    # see pytorch/pytorch#179291). The exit handlers (torch_pipeline's waits for its tasks among
    # them) still run, with the interpreter alive.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
