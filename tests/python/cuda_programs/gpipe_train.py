"""A CUDA training loop on torchgpipe (kakaobrain/torchgpipe, installed from PyPI, run as it is):
GPipe over two CUDA devices, four micro-batches, checkpointing; its CUDA path has its own copy
streams, record_stream and wait_stream. ``--cpu`` trains the same on the CPU (the reference)."""
import sys

import torch
from torch import nn
from torchgpipe import GPipe

CPU = "--cpu" in sys.argv
devices = ["cpu", "cpu"] if CPU else ["cuda:0", "cuda:1"]

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
model = GPipe(model, balance=[3, 2], devices=devices, chunks=4, checkpoint="except_last")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 32).to(devices[0])
y = torch.randint(0, 10, (32,)).to(devices[1])
for step in range(3):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", step, "loss", loss.item())
print("weight sum", model[0].weight.sum().item())
