"""A non_blocking copy to pinned host memory read before the copy's stream is synchronized. With
``--bug`` the host sums the buffer while the copy may still be running (on a GPU: garbage or
stale values)."""
import sys

import torch

BUG = "--bug" in sys.argv


def main():
    x = torch.arange(1024.0, device="cuda") * 2
    host = torch.empty(1024, pin_memory=True)
    host.copy_(x, non_blocking=True)  # LINE:write
    if not BUG:
        torch.cuda.current_stream().synchronize()
    print("sum", host.sum().item())  # LINE:read


main()
