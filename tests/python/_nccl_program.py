"""What test_comm_gpu.py runs in a process of its own: NCCL with world size 1.

    python tests/python/_nccl_program.py [untracked]

Prints one JSON line: whether the collective ran with the comm stream current and the values the
consumer saw. With "untracked" automatic synchronization is switched off (the test-only switch).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import torch_pipeline as tp


def main() -> None:
    if sys.argv[1:] == ["untracked"]:
        tp._C._set_tracking_enabled(False)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 1_000_000 / start.elapsed_time(end)

    producer = tp.Pipeline()
    ok_streams = True
    values = []
    for i in range(5):
        x = torch.zeros(1 << 20, device="cuda")
        out = torch.empty(1 << 20, device="cuda")
        torch.cuda.synchronize()
        with tp.pipeline(producer):
            torch.cuda._sleep(int(20 * cycles_per_ms))
            x.fill_(float(i + 1))                       # the producer, late
        with tp.collective():
            ok_streams &= torch.cuda.current_stream() == tp.comm_stream()
            dist.all_gather_into_tensor(out, x)         # async_op=False: on the comm stream
        values.append((out * 2).sum().item() / (2 * (1 << 20)))  # the consumer
    dist.destroy_process_group()
    print(json.dumps({"comm_stream_current": bool(ok_streams), "values": values,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
