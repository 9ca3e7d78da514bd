"""One side stream per layer, for overlap, and a stream for the loss. With ``--bug`` there are
32 layers: the loss stream is the 33rd stream of the pool (32 per priority per device, round
robin), the same stream as the first layer's, which is still alive."""
import sys

import torch

LAYERS = 32 if "--bug" in sys.argv else 31


def main():
    layers = [torch.nn.Linear(8, 8).cuda() for _ in range(LAYERS)]
    streams = [torch.cuda.Stream() for _ in layers]  # LINE:layers
    loss_stream = torch.cuda.Stream()  # LINE:loss
    x = torch.randn(4, 8, device="cuda")
    outs = []
    for layer, s in zip(layers, streams):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(layer(x))
    for s in streams:
        loss_stream.wait_stream(s)
    with torch.cuda.stream(loss_stream):
        loss = torch.stack(outs).square().mean()
    torch.cuda.current_stream().wait_stream(loss_stream)
    print("loss", loss.item())


main()
