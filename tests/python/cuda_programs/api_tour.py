"""The torch.cuda API a stream program uses, on sim under ``python -m torch_pipeline.sim run``:
every statement asserts what CUDA would give; the run must end with no races."""
import concurrent.futures
import threading

import torch

assert torch.cuda.is_available() and torch.cuda.is_initialized()
assert torch.cuda.device_count() == 2
assert torch.cuda.current_device() == 0
assert torch.cuda.get_device_capability() >= (7, 0)

# Devices: strings, torch.device, .cuda(), .to(), modules; and the checks programs make.
x = torch.ones(4, device="cuda")
assert x.is_cuda and x.device.type == "cuda" and x.device == torch.device("cuda:0")
assert torch.zeros(2, device=torch.device("cuda", 1)).device == torch.device("cuda:1")
assert torch.ones(2).cuda(1).device.index == 1
assert torch.ones(2).to("cuda:1").is_cuda
assert torch.ones(2).to(x.device).device == x.device
assert not torch.ones(2).is_cuda
with torch.cuda.device(1):
    assert torch.cuda.current_device() == 1
    assert torch.empty(1, device="cuda").device.index == 1
assert torch.cuda.current_device() == 0
with torch.cuda.device_of(torch.ones(1, device="cuda:1")):  # the tensor's device, as on CUDA
    assert torch.cuda.current_device() == 1
assert torch.cuda.current_device() == 0
m = torch.nn.Linear(4, 2).cuda()
assert all(p.is_cuda for p in m.parameters()) and next(m.parameters()).device.type == "cuda"
try:
    torch.cuda.set_device(7)
except RuntimeError as e:  # CUDA raises RuntimeError for an invalid ordinal
    assert "invalid device ordinal" in str(e)
else:
    raise AssertionError("set_device(7) on 2 devices did not raise")

# Streams and events.
s = torch.cuda.Stream(priority=-1)
assert isinstance(s, torch.cuda.Stream) and s.priority == -1
assert torch.cuda.current_stream() == torch.cuda.default_stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    assert torch.cuda.current_stream() == s
    y = x * 2
    y.record_stream(s)
s1 = torch.cuda.Stream(device=1)
with torch.cuda.stream(s1):  # the stream's device is current inside, as on CUDA
    assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() == s1
    assert torch.empty(1, device="cuda").device.index == 1
assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) != s1
ev = torch.cuda.Event(enable_timing=True)
ev.record(s)
torch.cuda.current_stream().wait_event(ev)
z = y + 1
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
z = z * 3
end.record()
end.synchronize()
assert end.query() and start.elapsed_time(end) >= 0
torch.cuda.synchronize()
assert z.tolist() == [9.0] * 4

# Pinned memory and non_blocking copies, ordered by a synchronize.
host = torch.arange(8.0).pin_memory()
dev = host.to("cuda", non_blocking=True)
back = torch.empty(8, pin_memory=True)
back.copy_(dev * 2, non_blocking=True)
torch.cuda.current_stream().synchronize()
assert back.tolist() == [2.0 * i for i in range(8)]

# Autocast on "cuda" and the deprecated torch.cuda.amp spelling.
a = torch.randn(4, 4, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    assert (a @ a).dtype == torch.bfloat16
with torch.cuda.amp.autocast(dtype=torch.float16):
    assert (a @ a).dtype == torch.float16

# Seeds: torch.manual_seed reaches the generator sim ops draw from.
torch.manual_seed(0)
r1 = torch.randn(3, device="cuda")
torch.cuda.manual_seed_all(0)
r2 = torch.randn(3, device="cuda")
assert torch.equal(r1, r2)
assert torch.cuda.memory_allocated() > 0


# Threads started by the program see "cuda" too.
def work(i):
    t = torch.full((2,), float(i), device="cuda")
    assert t.is_cuda and t.device.type == "cuda"
    return t.sum().item()


results = []
thread = threading.Thread(target=lambda: results.append(work(1)))
thread.start()
thread.join()
with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results += list(pool.map(work, [2, 3]))
assert results == [2.0, 4.0, 6.0], results
print("api tour: ok")
