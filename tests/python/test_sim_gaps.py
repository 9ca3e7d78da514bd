"""Programs that once crashed or failed on the sim device, or computed other values than the CPU.

Each test states the behaviour it checks. They run in a child pytest process of their own (enabling
sim is for the whole process, see _sim_child.py); TORCH_PIPELINE_SIM_TEST_CHILD=1 runs them
in-process.
"""
from __future__ import annotations

import io
from typing import Any, Callable, Iterator

import pytest
import torch

from _sim_child import IN_CHILD, install_proxies, sim_enabled_fixture

if IN_CHILD:
    import torch_pipeline.sim as sim

F = torch.nn.functional


_sim_enabled = sim_enabled_fixture(num_devices=2)


@pytest.fixture(autouse=True)
def _no_races() -> Iterator[None]:
    """Every program here runs on the default streams: no race may be reported."""
    if not IN_CHILD:
        yield
        return
    sim.clear_races()
    yield
    assert sim.races() == []


def on_sim(t: torch.Tensor, device: str = "sim:0") -> torch.Tensor:
    return t.detach().to(device).requires_grad_(t.requires_grad)


def cpu(t: Any) -> Any:
    return t.cpu() if isinstance(t, torch.Tensor) else t


# ---- crashes in the fallback's copy of results into sim memory --------------------------------
def test_efficient_zero_tensor_is_zeros_on_sim() -> None:
    """An efficient zero tensor (no memory of its own) made on sim is a sim tensor of zeros; the
    fallback used to read its null data pointer and crash the process."""
    z = torch._efficientzerotensor((4,), device="sim:0")
    assert z.device == torch.device("sim:0")
    assert torch.equal(z.cpu(), torch.zeros(4))


def test_forward_mode_ad_with_a_scalar_matches_cpu() -> None:
    """torch.func.jvp through a multiplication by a Python scalar (whose tangent is an efficient
    zero tensor) runs on sim and gives the CPU's primal and tangent; it used to crash."""
    x = torch.randn(5)
    fn = lambda a: a.sin() * 2  # noqa: E731
    expected = torch.func.jvp(fn, (x,), (torch.ones_like(x),))
    xs = x.to("sim:0")
    got = torch.func.jvp(fn, (xs,), (torch.ones_like(xs),))
    assert all(torch.equal(cpu(g), e) for g, e in zip(got, expected))


# ---- autocast, checkpoint, load ---------------------------------------------------------------------
def test_autocast_casts_like_cuda_and_computes_like_the_cpu() -> None:
    """Under torch.autocast("sim") matmuls run in float16 (CUDA's lists; float16 is sim's default
    autocast dtype), layer_norm in float32, ops of no list untouched; values are the CPU's for the
    same casts. Without sim's autocast kernels every op under autocast failed."""
    a, b, w = torch.randn(4, 8), torch.randn(8, 3), torch.randn(3)
    with torch.autocast("sim"):
        mm = on_sim(a) @ on_sim(b)
        ln = F.layer_norm(mm, (3,), on_sim(w))
        noise = torch.randn(2, device="sim:0")  # normal_: no list, falls through
    assert mm.dtype == torch.float16 and ln.dtype == torch.float32 and noise.dtype == torch.float32
    assert torch.equal(mm.cpu(), a.half() @ b.half())
    assert torch.equal(ln.cpu(), F.layer_norm(mm.cpu().float(), (3,), w))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_backward_under_autocast_matches_plain_backward(reentrant: bool) -> None:
    """torch.utils.checkpoint's backward re-enters autocast("sim") to recompute; the gradients equal
    those of the same program without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    w0, x = torch.randn(6, 6), torch.randn(3, 6)
    grads = []
    for use_checkpoint in (False, True):
        w = on_sim(w0).requires_grad_()
        fn = lambda t, v: (t @ v).relu().sum(1)  # noqa: E731
        with torch.autocast("sim"):
            xs = on_sim(x)
            y = checkpoint(fn, xs, w, use_reentrant=reentrant) if use_checkpoint else fn(xs, w)
        y.float().sum().backward()
        grads.append(w.grad.cpu())
    assert torch.equal(grads[0], grads[1])


def test_checkpoint_backward_without_autocast_matches_plain_backward() -> None:
    """Activation checkpointing on sim (no autocast): same gradients as without it."""
    from torch.utils.checkpoint import checkpoint

    w0 = torch.randn(5, 5)
    grads = []
    for use_checkpoint in (False, True):
        w = on_sim(w0).requires_grad_()
        fn = lambda t: (t @ t).sin()  # noqa: E731
        (checkpoint(fn, w, use_reentrant=False) if use_checkpoint else fn(w)).sum().backward()
        grads.append(w.grad.cpu())
    assert torch.equal(grads[0], grads[1])


def test_load_of_a_sim_checkpoint_without_map_location() -> None:
    """torch.load of a checkpoint saved from sim:1, without map_location, gives the tensors back on
    sim:1 with their values."""
    state = {"w": torch.arange(6.0).reshape(2, 3).to("sim:1"), "step": 3}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["w"].device == torch.device("sim:1") and loaded["step"] == 3
    assert torch.equal(loaded["w"].cpu(), torch.arange(6.0).reshape(2, 3))


# ---- RNNs: PyTorch's fused cells for PrivateUse1 -----------------------------------------------------
RNNS: dict = {
    "LSTM": lambda: torch.nn.LSTM(3, 4),
    "LSTM_2layer_bidirectional": lambda: torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True),
    "GRU": lambda: torch.nn.GRU(3, 4, batch_first=True),
    "GRU_no_bias": lambda: torch.nn.GRU(3, 4, bias=False),
    "LSTMCell": lambda: torch.nn.LSTMCell(3, 4),
    "GRUCell": lambda: torch.nn.GRUCell(3, 4),
}


@pytest.mark.parametrize("name", sorted(RNNS))
def test_rnns_and_their_cells_match_cpu(name: str) -> None:
    """nn.LSTM/GRU and their cells run on sim (PyTorch takes CUDA's fused-cell path for PrivateUse1,
    whose ops had no kernel) and give the CPU's outputs and gradients to float32 rounding (the fused
    cells add the biases in another order than the CPU's cells)."""
    torch.manual_seed(0)
    model = RNNS[name]()
    x = torch.randn(5, 3) if "Cell" in name else torch.randn(6, 5, 3)
    results = []
    for device in ("cpu", "sim:0"):
        m = model.to(device)
        m.zero_grad()
        out = m(x.to(device))
        out = out[0] if isinstance(out, tuple) else out
        out.pow(2).sum().backward()
        results.append((out.detach().cpu(), [p.grad.cpu() for p in m.parameters()]))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("bias", [True, False])
def test_fused_cell_gradients_are_right(bias: bool) -> None:
    """The backward kernels of the fused LSTM and GRU cells on sim agree with numerical gradients
    (gradcheck in float64; both LSTM outputs hy and cy carry gradient)."""
    torch.manual_seed(0)
    opts = dict(dtype=torch.float64, device="sim:0", requires_grad=True)
    b, h = 3, 2
    lstm = [torch.randn(b, 4 * h, **opts), torch.randn(b, 4 * h, **opts), torch.randn(b, h, **opts)]
    gru = [torch.randn(b, 3 * h, **opts), torch.randn(b, 3 * h, **opts), torch.randn(b, h, **opts)]
    if bias:
        lstm += [torch.randn(4 * h, **opts), torch.randn(4 * h, **opts)]
        gru += [torch.randn(3 * h, **opts), torch.randn(3 * h, **opts)]
    assert torch.autograd.gradcheck(lambda *a: torch.ops.aten._thnn_fused_lstm_cell(*a)[:2], lstm)
    assert torch.autograd.gradcheck(lambda *a: torch.ops.aten._thnn_fused_gru_cell(*a)[0], gru)


# ---- nested tensors, torch.compile -----------------------------------------------------------------
def _encoder(enable_nested_tensor: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=enable_nested_tensor).eval()


def test_transformer_encoder_with_padding_mask_names_the_workaround() -> None:
    """nn.TransformerEncoder in eval with a src_key_padding_mask turns its input into a nested
    tensor, which sim has no form of: the error says so and names enable_nested_tensor=False (it used
    to be PyTorch's "NestedTensorImpl doesn't support strides"); with that flag the encoder runs and
    gives the CPU's result."""
    src = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
            _encoder(True).to("sim:0")(src.to("sim:0"), src_key_padding_mask=mask.to("sim:0"))
        expected = _encoder(False)(src, src_key_padding_mask=mask)
        got = _encoder(False).to("sim:0")(src.to("sim:0"), src_key_padding_mask=mask.to("sim:0"))
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True)


def test_sparse_results_are_refused_clearly() -> None:
    """A CPU kernel returning a sparse tensor for a sim op raises a NotImplementedError naming the
    op and the layout (sim tensors are strided), not PyTorch's internal "no strides" error."""
    with pytest.raises(NotImplementedError, match="strided tensors only"):
        torch.eye(3, device="sim:0").to_sparse()


def test_torch_compile_refuses_inductor_clearly_and_runs_with_aot_eager() -> None:
    """torch.compile's default backend fails on sim with a message naming backend='aot_eager' (it
    was inductor's KeyError: 'sim'); with aot_eager the compiled function gives eager's values."""
    fn = lambda a: (a.sin() * 2).sum(0)  # noqa: E731
    x = torch.randn(4, 3, device="sim:0")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend='aot_eager'"):
        torch.compile(fn)(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="aot_eager")(x).cpu(), fn(x.cpu()))
    torch._dynamo.reset()


# ---- numerics: the CPU kernel, not a composite ----------------------------------------------------
EXACT: dict = {
    "layer_norm": lambda x, w, b: F.layer_norm(x, (8,), w, b),
    "group_norm": lambda x, w, b: F.group_norm(x, 2, w, b),
    "sdpa": lambda x, w, b: F.scaled_dot_product_attention(*[x.view(1, 2, 3, 8) * w] * 3),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_ops_with_a_cpu_kernel_and_a_composite_give_the_cpus_bits(name: str) -> None:
    """layer_norm and group_norm (each with both a CPU kernel and a composite that the dispatcher
    would pick for sim) and scaled_dot_product_attention (which picks its kernel per
    device) give the CPU's results and gradients bit for bit; layer_norm used to differ by 1e-7."""
    torch.manual_seed(0)
    args = [torch.randn(6, 8, requires_grad=True), torch.randn(8, requires_grad=True),
            torch.randn(8, requires_grad=True)]
    results = []
    for dev_args in (args, [on_sim(a) for a in args]):
        out = EXACT[name](*dev_args)
        grads = torch.autograd.grad(out.pow(2).sum(), dev_args, allow_unused=True)
        results.append([cpu(out.detach())] + [cpu(g) for g in grads])
    for got, expected in zip(results[1], results[0]):
        assert (got is None and expected is None) or torch.equal(got, expected)


# ---- enable -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [2**40, 0, -1, 17])
def test_enable_names_the_allowed_device_counts(count: int) -> None:
    """sim.enable with a device count out of [1, 16] raises our ValueError naming the range (2**40
    used to be pybind11's "incompatible function arguments" of a private function)."""
    with pytest.raises(ValueError, match=r"num_devices must be in \[1, 16\]"):
        sim.enable(count)


install_proxies(globals(), __file__)
