"""Gradients all-reduced on a side stream, for overlap (DDP by hand, NCCL). With ``--bug`` the side
stream does not wait for the default stream, where the backward wrote the gradients: NCCL's
kernel, ordered after the side stream only, reads them unordered."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist

BUG = "--bug" in sys.argv


def main():
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", init_method="file://" + store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).cuda()
    x = torch.randn(8, 16, device="cuda")
    model(x).square().mean().backward()  # LINE:backward
    comm = torch.cuda.Stream()
    if not BUG:
        comm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(comm):
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]  # LINE:reduce
    for work in works:
        work.wait()  # the default stream waits for the all-reduce
    print("grad", round(model.weight.grad.sum().item(), 4))
    dist.destroy_process_group()


main()
