"""What test_comm_gpu.py runs in a process of its own: NCCL with world size 1.

    python tests/python/_nccl_program.py [untracked] [async]

Prints one JSON line: whether the collective ran with the comm stream current and the values the
consumer saw. With "untracked" automatic synchronization is switched off (the test-only switch);
with "async" the collective is issued with async_op=True (on the process group's own stream) and
waited for on another pipeline.
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
    if "untracked" in sys.argv[1:]:
        tp._C._set_tracking_enabled(False)
    use_async = "async" in sys.argv[1:]
    waiter = tp.Pipeline()
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
            work = dist.all_gather_into_tensor(out, x, async_op=use_async)  # sync: comm stream
        if use_async:
            with tp.pipeline(waiter):
                work.wait()                             # the waiter's stream waits for it
        values.append((out * 2).sum().item() / (2 * (1 << 20)))  # the consumer
    dist.destroy_process_group()
    print(json.dumps({"comm_stream_current": bool(ok_streams), "values": values,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
