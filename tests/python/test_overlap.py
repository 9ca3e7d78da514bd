"""The overlap helpers users ask for (tp.carry, tp.item_async, tp.prefetch, tp.offload), on the sim device in
strict mode: each gives the synchronous program's values with no race, and its untracked twin
(tracking off with the test-only switch) races, so the tests fail when automatic synchronization
stops ordering them.

Runs in a child process of its own (see _sim_child.py): enabling sim is process-wide.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn as nn

from _sim_child import IN_CHILD, install_proxies, tracked_sim_fixtures, untracked

if IN_CHILD:
    import torch_pipeline as tp
    import torch_pipeline.sim as sim

_sim_enabled, _fresh_state = tracked_sim_fixtures(num_devices=2)


# ---- carry ----------------------------------------------------------------------------------------
def test_carry_runs_threads_under_the_pipeline_current_where_it_was_made() -> None:
    p = tp.Pipeline()
    seen = {}

    def where(key: str) -> None:
        seen[key] = (tp.current_pipeline(), torch.accelerator.current_stream(0))

    with tp.pipeline(p):
        t = threading.Thread(target=where, args=("plain",))
        t.start(); t.join()
        t = threading.Thread(target=tp.carry(where), args=("carried",))
        t.start(); t.join()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(tp.carry(where), "pool").result()
    assert seen["plain"][0].is_default          # PyTorch's behaviour: streams are thread-local
    assert seen["carried"][0] == p and seen["pool"][0] == p
    assert seen["carried"][1] == p.stream("sim:0")
    q = tp.Pipeline()
    t = threading.Thread(target=tp.carry(pipeline=q)(where), args=("explicit",))
    t.start(); t.join()
    assert seen["explicit"][0] == q


def _carried_work(p: "tp.Pipeline") -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(4096.0).to("sim:0") * 3          # written on the default stream
    out: List[torch.Tensor] = []
    with tp.pipeline(p):
        t = threading.Thread(target=tp.carry(lambda: out.append(torch.sin(x) + 1)))
        t.start(); t.join()
    return out[0] * 2, torch.sin(x.cpu()) * 2 + 2       # read back on the default stream


def test_carried_thread_is_ordered_like_the_thread_that_made_it() -> None:
    got, want = _carried_work(tp.Pipeline())
    assert sim.races() == []
    assert torch.equal(got.cpu(), want)
    with untracked():
        _carried_work(tp.Pipeline())
        assert sim.races(), "untracked, the carried thread's read did not race"


def test_carry_bad_input() -> None:
    with pytest.raises(TypeError, match="callable"):
        tp.carry(3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="Pipeline"):
        tp.carry(print, pipeline="p")  # type: ignore[arg-type]


# ---- item_async -----------------------------------------------------------------------------------
def _losses(steps: int, lane: Any = None) -> List[Any]:
    w = torch.arange(1024.0).to("sim:0")
    futures = []
    for i in range(steps):
        w = w * 0.5 + i                                  # each step writes a new value
        futures.append(tp.item_async({"loss": w.sum(), "step": i, "first": [w[0]]},
                                     pipeline=lane))
    return [f.wait() for f in futures]


def test_item_async_reads_each_value_after_its_producer() -> None:
    """Values equal .item()'s. The read is a task, and a task's streams wait for what its
    submitter had queued (the submit rule), so it stays ordered even with tracking off."""
    got = _losses(5)
    w = torch.arange(1024.0)
    want = []
    for i in range(5):
        w = w * 0.5 + i
        want.append({"loss": w.sum().item(), "step": i, "first": [w[0].item()]})
    assert got == want
    assert sim.races() == []
    lane = tp.Pipeline(3)
    lane.stream("sim:0")  # (untracked, a pipeline uses only the streams it already has)
    with untracked():
        assert _losses(5, lane) == want
        assert sim.races() == []


def test_item_async_returns_before_the_read_happens() -> None:
    """The caller does not wait: with the read lane's worker thread busy, item_async returns an
    unfinished future at once, and the value arrives once the lane is free."""
    lane = tp.Pipeline(tp.get_worker_thread(tp.max_worker_threads() - 1))
    release = threading.Event()
    blocker = lane.submit(release.wait, 10)
    x = torch.full((1,), 7.0).to("sim:0")
    fut = tp.item_async(x + 1, pipeline=lane)
    assert not fut.done()
    release.set()
    assert fut.wait() == 8.0
    blocker.wait()


def test_item_async_on_the_host_and_bad_input() -> None:
    fut = tp.item_async([torch.tensor(2.5), torch.tensor([3])])
    assert fut.done() and fut.wait() == [2.5, 3]
    assert isinstance(fut, torch.futures.Future)
    with pytest.raises(ValueError, match="one-element"):
        tp.item_async(torch.zeros(2).to("sim:0"))


# ---- prefetch -------------------------------------------------------------------------------------
def _batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g))
            for _ in range(n)]


def _consume(batches: Any) -> List[torch.Tensor]:
    w = torch.ones(32, 4).to("sim:0")
    return [((x @ w) + y[:, None]).cpu() for x, y in batches]


def test_prefetch_equals_the_synchronous_loop() -> None:
    data = _batches(6)
    want = _consume((x.to("sim:0"), y.to("sim:0")) for x, y in data)
    for depth in (1, 2, 4):
        got = _consume(tp.prefetch(data, "sim:0", depth=depth))
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    assert sim.races() == []
    with untracked():
        _consume(tp.prefetch(data, "sim:0", depth=2))
        assert sim.races(), "untracked, the consumer did not race with the copies"


def test_prefetch_with_a_dataloader_len_break_and_errors() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.arange(40))
    for pin, workers in ((False, 0), (True, 0), (True, 2)):
        loader = torch.utils.data.DataLoader(data, batch_size=8, pin_memory=pin,
                                             num_workers=workers)
        pf = tp.prefetch(loader, "sim:0")
        assert len(pf) == 5
        got = [x.sum().item() + y.sum().item() for x, y in pf]
        want = [x.sum().item() + y.sum().item() for x, y in loader]
        assert got == want
    q = tp.Pipeline()
    for i, _ in enumerate(tp.prefetch(loader, "sim:0", depth=3, pipeline=q)):
        if i == 1:
            break                                  # the copies in flight are finished, not lost
    assert q.query()

    def broken() -> Any:
        yield torch.ones(2)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        for _ in tp.prefetch(broken(), "sim:0"):
            pass
    with pytest.raises(ValueError, match="depth"):
        tp.prefetch([], "sim:0", depth=0)
    assert list(tp.prefetch([torch.ones(1)], "cpu")) == [torch.ones(1)]
    assert sim.races() == []


# ---- offload --------------------------------------------------------------------------------------
def _train_step(model: "nn.Module", x: torch.Tensor, p: Any, off: Any) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with tp.pipeline(p):
        if off is None:
            loss = model(x).square().mean()
        else:
            with off:
                loss = model(x).square().mean()
        loss.backward()
    return [q.grad.cpu() for q in model.parameters()]


def _model() -> Tuple["nn.Module", torch.Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 8)).to("sim:0")
    return model, torch.randn(64, 32).to("sim:0")


def test_offload_gives_the_gradients_of_keeping_activations() -> None:
    model, x = _model()
    want = _train_step(model, x, None, None)
    for p in (None, tp.Pipeline()):
        off = tp.offload(min_bytes=16 * 1024)
        got = _train_step(model, x, p, off)
        assert off.offloaded >= 4 and off.restored == off.offloaded
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    bounded = tp.offload(min_bytes=16 * 1024, max_in_flight=0)  # the host waits for each copy
    assert all(torch.equal(a, b) for a, b in zip(_train_step(model, x, None, bounded), want))
    assert bounded.offloaded >= 4
    small = tp.offload(min_bytes=1 << 30)
    _train_step(model, x, None, small)
    assert small.offloaded == 0
    assert sim.races() == []
    with untracked():
        _train_step(model, x, None, tp.offload(min_bytes=0))
        assert sim.races(), "untracked, backward did not race with the copies back"


@pytest.mark.timeout(120)
def test_helpers_on_the_asynchronous_sim_device() -> None:
    """With kernels that take time (asynchronous sim mode), offload and prefetch still give the
    synchronous program's values; their copies run on the device's queues, whose CPU work the
    tracker must not mistake for the program's (it once made a queued copy wait for itself)."""
    model, x = _model()
    want = _train_step(model, x, None, None)
    data = _batches(4)
    want_pf = _consume((a.to("sim:0"), b.to("sim:0")) for a, b in data)
    sim.set_asynchronous(True)
    sim.set_latency(launch_us=200)
    try:
        off = tp.offload(min_bytes=16 * 1024)
        got = _train_step(model, x, tp.Pipeline(), off)
        got_pf = _consume(tp.prefetch(data, "sim:0", depth=2))
        values = _losses(3)
    finally:
        sim.clear_latency()
        sim.set_asynchronous(False)
    assert off.offloaded >= 4
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_pf, want_pf))
    assert [v["step"] for v in values] == [0, 1, 2]
    assert sim.races() == []


class _ConvNeXtBlock(nn.Module):
    """timm's ConvNeXt block: depthwise 7x7 conv, then channels last (a permuted view) through
    LayerNorm, an MLP and a layer scale, permuted back, plus the residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.gamma * self.fc2(self.act(self.fc1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class _Layouts(nn.Module):
    """Saved tensors of every layout: channels-last conv activations, permuted ones, ConvNeXt
    blocks, a view with gaps (a GLU's halves), a view at an odd offset, an expanded one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(_ConvNeXtBlock(16), _ConvNeXtBlock(16))
        self.conv = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(torch.nn.functional.gelu(self.blocks(self.stem(x))))
        a, b = h.permute(0, 2, 3, 1).chunk(2, dim=-1)       # views with gaps
        g = (a * torch.sigmoid(b)).flatten(1, 2)            # (N, HW, 16)
        s = g.narrow(1, 1, g.size(1) - 1) * torch.sigmoid(g.narrow(1, 0, g.size(1) - 1))
        w = torch.tanh(s.mean(1, keepdim=True))             # (N, 1, 16)
        e = s * w.expand_as(s)                              # saves an expanded tensor
        return self.head(torch.sin(e.narrow(1, 1, e.size(1) - 2)))


class _Layout(torch.autograd.Function):
    """Identity that saves its input; records the layout it saved and the one backward got."""
    saved: List[Tuple[Any, ...]] = []
    seen: List[Tuple[Any, ...]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        _Layout.saved.append((x.size(), x.stride(), x.data_ptr() % 256))
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _Layout.seen.append((x.size(), x.stride(), x.data_ptr() % 256))
        return grad


def _layout_makers() -> List[Any]:
    def base() -> torch.Tensor:
        return torch.randn(8, 33, 64, device="sim:0", requires_grad=True) * 1

    return [lambda: (torch.randn(4, 16, 32, 32, device="sim:0", requires_grad=True) * 1)
            .contiguous(memory_format=torch.channels_last),
            lambda: base().permute(2, 0, 1),                    # dense, permuted
            lambda: base()[:, 1:, :],                           # a view with gaps, at an offset
            lambda: base()[:, :, ::2],                          # gaps in the innermost dim
            lambda: base()[1, 3].expand(64, 64),                # stride 0
            lambda: base().flatten()[1:]]                       # dense view, 4 bytes in


def test_offload_keeps_the_layout_of_saved_tensors() -> None:
    """Backward gets each offloaded tensor back with the sizes, strides and alignment it was
    saved with (channels last, permuted, views with gaps or at an offset, expanded), so the
    kernels it takes, and their rounding, are those of training without offload: the gradients
    of channels-last convolutions, permuted activations and ConvNeXt blocks are bit-equal, in
    the synchronous and the asynchronous sim modes."""
    _Layout.saved.clear(); _Layout.seen.clear()
    with tp.offload(min_bytes=0) as off:
        ys = [_Layout.apply(make()) for make in _layout_makers()]  # (only the graph keeps them)
    for y in ys:
        y.sum().backward()
    assert off.restored >= len(ys) and off.reused == 0
    assert _Layout.seen == _Layout.saved

    torch.manual_seed(3)
    model = _Layouts().to("sim:0").to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16).to("sim:0").to(memory_format=torch.channels_last)
    for asynchronous in (False, True):
        sim.set_asynchronous(asynchronous)  # (its kernels run on other threads: other rounding)
        try:
            want = _train_step(model, x, None, None)
            off = tp.offload(min_bytes=0)
            got = _train_step(model, x, tp.Pipeline(), off)
        finally:
            sim.set_asynchronous(False)
        assert off.restored > 20
        assert all(torch.equal(a, b) for a, b in zip(got, want)), asynchronous
    assert sim.races() == []


def test_offload_frees_the_device_memory_of_activations() -> None:
    """A deep, activation-heavy step keeps a fraction of its activations on the device under
    offload (the ones copied back ahead of need); inputs the caller holds and parameters are
    used in place rather than copied back as duplicates; the gradients are bit-equal."""
    torch.manual_seed(2)
    hidden = [m for _ in range(6) for m in (nn.Linear(256, 256), nn.GELU())]
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), *hidden, nn.Linear(256, 8)).to("sim:0")
    x = torch.randn(1024, 64).to("sim:0")  # 256 KiB, saved by the first layer

    def peak(off: Any) -> Tuple[int, List[torch.Tensor]]:
        grads = _train_step(model, x, None, None)  # (warm: the gradients exist in both runs)
        tp.synchronize()
        torch.accelerator.reset_peak_memory_stats(0)
        base = torch.accelerator.memory_allocated(0)
        grads = _train_step(model, x, tp.Pipeline(), off)
        tp.synchronize()
        return torch.accelerator.max_memory_allocated(0) - base, grads

    keep, want = peak(None)
    off = tp.offload(min_bytes=64 * 1024)
    offloaded, got = peak(off)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert off.reused == 7, "the input and the 6 hidden weights were copied back as duplicates"
    assert off.restored == off.offloaded - 1  # all but the input, which the caller still holds
    # 15 activations of 1 MiB kept vs about 3 on the device at once (measured: 13.5 vs 3.9 MiB)
    assert offloaded < 0.6 * keep, (offloaded, keep)
    assert sim.races() == []


def test_offload_refuses_a_saved_tensor_written_in_place_like_autograd() -> None:
    """Autograd refuses to run backward when a tensor it saved was written in place since
    forward; under offload the same program raises the same error (never a gradient computed
    from the new values, which the copy out may even have read), for an activation, an input the
    caller holds and a parameter alike."""
    model, x = _model()
    x = x.clone()

    def forward_then_write(off: Any, write: Any) -> "torch.Tensor":
        model.zero_grad(set_to_none=True)
        with off if off is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
        tp.synchronize()  # (the copies out have run: the write does not race them)
        with torch.no_grad():
            write()
        return loss

    for write in (lambda: x.add_(1), lambda: model[2].weight.mul_(2)):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            forward_then_write(None, write).backward()  # (autograd itself)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            forward_then_write(tp.offload(min_bytes=4 * 1024), write).backward()
    assert sim.races() == []


def test_tensors_written_after_offload_wait_for_their_copies_out() -> None:
    """Writing a saved tensor once backward is done (or when no backward runs) is legal, and the
    write must not overtake the copy out still reading it on the lane: an input the caller holds
    (backward used it in place, so it never waited for the lane), an output its op saved and the
    caller keeps, and the output of a forward never differentiated."""
    x = torch.randn(512, 1024).to("sim:0")  # 2 MiB: the only tensor offloaded
    lin = nn.Linear(1024, 8).to("sim:0")
    w = torch.randn(512, 1024, device="sim:0", requires_grad=True)
    for _ in range(2):
        with tp.offload(min_bytes=1 << 20) as off:
            loss = lin(x).square().mean()
        loss.backward()
        assert (off.offloaded, off.reused) == (1, 1)
        x.add_(1)
        with tp.offload(min_bytes=1 << 20):
            y = torch.sigmoid(w)  # saves y, its own output
            y.sum().backward()
        y.detach().mul_(2)
        with tp.offload(min_bytes=1 << 20):
            z = (w * 3).exp()
        z.detach().add_(1)
        w.grad = None
    assert sim.races() == []


def test_offload_bad_input() -> None:
    with pytest.raises(ValueError, match="min_bytes"):
        tp.offload(min_bytes=-1)
    with pytest.raises(ValueError, match="max_in_flight"):
        tp.offload(max_in_flight=-1)
    off = tp.offload()
    with off:
        with pytest.raises(RuntimeError, match="already entered"):
            off.__enter__()


install_proxies(globals(), __file__)
