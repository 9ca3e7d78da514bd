"""An Apex-style data prefetcher (the pattern of NVIDIA Apex's ImageNet example): batches are
copied to the GPU on a side stream while the model runs on the default one. With ``--bug`` it
omits ``record_stream``: a batch allocated on the side stream is freed while the default stream
still reads it, and the side stream's next copy reuses its memory without waiting. With ``--tp``
the side stream is a torch_pipeline Pipeline, with neither wait_stream nor record_stream."""
import sys

import torch

BUG = "--bug" in sys.argv
TP = "--tp" in sys.argv


class DataPrefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        if TP:
            import torch_pipeline as tp

            self.lane = tp.Pipeline()
            self.context = lambda: tp.pipeline(self.lane)
        else:
            self.stream = torch.cuda.Stream()
            self.context = lambda: torch.cuda.stream(self.stream)
        self.preload()

    def preload(self):
        try:
            batch = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        with self.context():
            self.next_input = batch.cuda(non_blocking=True)  # LINE:copy

    def next(self):
        batch = self.next_input
        if not TP:
            torch.cuda.current_stream().wait_stream(self.stream)
            if batch is not None and not BUG:
                batch.record_stream(torch.cuda.current_stream())
        self.preload()
        return batch


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [torch.randn(32, 64).pin_memory() for _ in range(6)]
    prefetcher = DataPrefetcher(loader)
    batch = prefetcher.next()
    while batch is not None:
        loss = model(batch).square().mean()  # LINE:use
        opt.zero_grad()
        loss.backward()
        opt.step()
        batch = prefetcher.next()
    torch.cuda.synchronize()
    print("loss", float(loss))


main()
