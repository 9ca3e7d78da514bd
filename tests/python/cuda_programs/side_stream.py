"""A model run on a side stream for overlap, after a training step on the default stream. With
``--bug`` the side stream does not wait for the default stream, where the optimizer wrote the
weights and the input was made: the side stream's forward reads both unordered."""
import sys

import torch

BUG = "--bug" in sys.argv


def main():
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, device="cuda")  # LINE:input
    model(x).square().mean().backward()
    opt.step()  # LINE:step
    side = torch.cuda.Stream()
    if not BUG:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = model(x)  # LINE:read
    torch.cuda.current_stream().wait_stream(side)
    print("sum", y.sum().item())


main()
