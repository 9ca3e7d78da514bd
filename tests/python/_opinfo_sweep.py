"""PyTorch's operator database (OpInfo ``op_db``) on the sim device against the CPU.

For every op and variant, every dtype of ``DTYPES`` the op supports on the CPU, and up to
``max_samples`` of its samples: the sample is made on sim, a CPU twin of it is made with the same
storage layout, and the op's results, the gradients of its outputs (``backward``, where OpInfo says
the op supports autograd) and the tangents of its outputs (``forward_ad``, where OpInfo says so)
are compared bit for bit, and the op may warn on sim only where it warns on the CPU (``warns``:
a warning the CPU run does not give). A sample whose CPU results differ between two CPU runs is not compared
(the CPU is not reproducible on it: nondeterministic kernels). Run as a script for the numbers:

    python tests/python/_opinfo_sweep.py [--async] [--dtypes float32,float64] [--pipeline]

The test module test_sim_opinfo.py runs it in both modes. UNINITIALIZED, ADDRESS_DEPENDENT and
DEVICE_BRANCHES below list what is compared less than bit for bit, and WARNS_ONCE the warnings
not compared, each with its reason.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.float16,
          torch.complex64)

# Keep the lists below short: every entry is a place where the sim is not the CPU's twin.
# Results of these are uninitialised memory: only their shapes and dtypes are compared.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted", "torch.empty", "nn.functional.dropout"}
# Ops whose CPU kernel rounds differently depending on where its data lies, so a sim run, whose
# memory lies elsewhere, agrees with a CPU run to rounding only. linalg.lstsq: on this machine's
# LAPACK, the same 5x3 input copied to offsets 1..6 of a buffer gives solutions 1e-7 apart.
ADDRESS_DEPENDENT = {"linalg.lstsq"}
# Ops where PyTorch itself takes another path on a device that is not the CPU, so sim runs other
# kernels (or other dtypes) than the CPU run: compared to 1% (dtypes not compared) in the parts
# listed, and the largest difference is reported.
DEVICE_BRANCHES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "nn.functional.linear_cross_entropy.chunked": (("forward", "backward"), (
        "the chunked path picks its accumulation policy and chunking per device type "
        "(LinearCrossEntropyOptions._adjust: _AUTO_DEFAULTS[(device.type, dtype)]): 'sim' takes "
        "the fallback, 'cpu' its own entry; bfloat16/float16 differ by 1-4 ulps")),
    "nn.functional.linear_cross_entropy.chunked_none": (("forward", "backward"), (
        "as nn.functional.linear_cross_entropy.chunked")),
    "ldexp": (("forward_ad",), (
        "the tangent of a 0-dim sample is float64 on the CPU and float32 on sim, values equal: "
        "forward AD of pow(2.0, exponent) goes through PyTorch's zero-tensor mul, which computes "
        "its dtype on meta copies of the operands, where a 0-dim CPU operand is promoted as a "
        "dimensioned one only when every operand is on the CPU")),
}

# Warnings given on sim only that are not compared, each with its reason (the start of the message).
WARNS_ONCE = {
    "ComplexHalf support is experimental": (
        "a TORCH_WARN_ONCE at the first ComplexHalf tensor a process allocates; sim's meta "
        "computation of view_as_complex on float16 allocates one where the CPU's view does not, "
        "so whether the sim run warns depends on what the process did before"),
}


@dataclasses.dataclass
class Report:
    """What a sweep compared and found."""
    mode: str
    pairs: int = 0          # op x dtype pairs with at least one compared sample
    samples: int = 0        # samples compared (forward)
    backward: int = 0       # samples whose gradients were compared
    forward_ad: int = 0     # samples whose tangents were compared
    not_reproducible: int = 0  # samples skipped: the CPU differs from itself
    differ: Dict[str, str] = dataclasses.field(default_factory=dict)     # sim != CPU
    sim_only: Dict[str, str] = dataclasses.field(default_factory=dict)   # fails on sim only
    warns: Dict[str, str] = dataclasses.field(default_factory=dict)  # warns on sim only
    races: int = 0
    seconds: float = 0.0
    branches: Dict[str, float] = dataclasses.field(default_factory=dict)  # DEVICE_BRANCHES: max diff

    def line(self) -> str:
        return (f"[sim] OpInfo sweep, {self.mode}: {self.pairs} op x dtype pairs, {self.samples} "
                f"samples ({self.backward} with gradients, {self.forward_ad} with tangents), "
                f"{self.not_reproducible} not reproducible on the CPU; {len(self.differ)} differ, "
                f"{len(self.sim_only)} fail on sim only, {len(self.warns)} warn on sim only, {self.races} races, {self.seconds:.0f} s")


def _tree(x: Any) -> Tuple[List[Any], Any]:
    return torch.utils._pytree.tree_flatten(x)


def _map(f: Callable[[Any], Any], x: Any) -> Any:
    return torch.utils._pytree.tree_map(f, x)


def exact_cpu(t: Any) -> Any:
    """The CPU twin of a sample's value: a tensor with the same storage layout and bits."""
    if isinstance(t, torch.device) and t.type == "sim":
        return torch.device("cpu")
    if isinstance(t, str) and t.startswith("sim"):
        return "cpu"
    if not (isinstance(t, torch.Tensor) and t.device.type == "sim"):
        return t
    storage = t.untyped_storage().cpu()
    out = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        out = out.conj()
    if t.is_neg():
        out = out._neg_view()
    return out.requires_grad_(t.requires_grad)


def _to_cpu(t: Any) -> Any:
    """A sim tensor's values on the CPU with its conjugate and negative bits (``.cpu()`` would
    resolve them: a copy materializes the bits)."""
    if not (isinstance(t, torch.Tensor) and t.device.type == "sim"):
        return t
    t = t.detach()
    if t.is_conj():
        return _to_cpu(t.conj()).conj()
    if t.is_neg():
        return _to_cpu(t._neg_view())._neg_view()
    return t.cpu()


def same(got: Any, expected: Any) -> Optional[str]:
    """None when equal bit for bit (NaNs in the same places), else what differs."""
    a, b = _tree(got), _tree(expected)
    if a[1] != b[1]:
        return f"structure {a[1]} != {b[1]}"
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
                return f"[{i}] {type(x).__name__} != {type(y).__name__}"
            if not (x == y or (x != x and y != y)):
                return f"[{i}] {x!r} != {y!r}"
            continue
        if (x.shape, x.dtype, x.is_conj(), x.is_neg()) != (y.shape, y.dtype, y.is_conj(), y.is_neg()):
            return (f"[{i}] {tuple(x.shape)} {x.dtype} conj={x.is_conj()} neg={x.is_neg()} != "
                    f"{tuple(y.shape)} {y.dtype} conj={y.is_conj()} neg={y.is_neg()}")
        x, y = x.resolve_conj().resolve_neg(), y.resolve_conj().resolve_neg()
        if x.dtype.is_complex:
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        if x.dtype == torch.bool:
            x, y = x.to(torch.uint8), y.to(torch.uint8)
        equal = (x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y
        if not bool(equal.all()):
            diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
            return f"[{i}] values differ (max abs {diff:.3g}, {int((~equal).sum())} of {x.numel()})"
    return None


def _max_difference(got: Any, expected: Any) -> float:
    diffs = [(x.double() - y.double()).abs().max().item()
             for x, y in zip(_tree(got)[0], _tree(expected)[0])
             if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.numel()
             and not x.dtype.is_complex and x.dtype != torch.bool]
    return max(diffs, default=0.0)


def _grad_inputs(sample: Any) -> List[torch.Tensor]:
    leaves = _tree([sample.input, sample.args, sample.kwargs])[0]
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _differentiable(outputs: Any) -> List[torch.Tensor]:
    return [t for t in _tree(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad
            and (t.is_floating_point() or t.is_complex())]


def gradients(outputs: Any, inputs: List[torch.Tensor]) -> Optional[List[Optional[torch.Tensor]]]:
    """The gradients of the outputs (all-ones cotangents) with respect to the inputs."""
    outs = _differentiable(outputs)
    if not outs or not inputs:
        return None
    grads = torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs],
                                allow_unused=True)
    return [_to_cpu(g) for g in grads]


def tangents(op: Any, sample: Any) -> Optional[List[Any]]:
    """The forward-mode tangents of the op's outputs for an all-ones tangent of its first input."""
    import torch.autograd.forward_ad as fwAD

    x = sample.input
    if not (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())):
        return None
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        out = op(dual, *sample.args, **sample.kwargs)
        return [_to_cpu(fwAD.unpack_dual(t).tangent) if isinstance(t, torch.Tensor) else None
                for t in _tree(out)[0]]


def _cpu_sample(sample: Any) -> Any:
    from torch.testing._internal.opinfo.core import SampleInput

    return SampleInput(_map(exact_cpu, sample.input), args=_map(exact_cpu, sample.args),
                       kwargs=_map(exact_cpu, sample.kwargs))


def _run(op: Any, sample: Any, what: str) -> Any:
    """The op's results (what="forward"), gradients ("backward") or tangents ("forward_ad"),
    on the CPU."""
    torch.manual_seed(0)
    if what == "forward_ad":
        return tangents(op, sample)
    out = op(sample.input, *sample.args, **sample.kwargs)
    if what == "backward":
        return gradients(out, _grad_inputs(sample))
    if op.name in UNINITIALIZED:
        return [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else t for t in _tree(out)[0]]
    return _map(_to_cpu, out)


def sweep(dtypes: Sequence[torch.dtype] = DTYPES, asynchronous: bool = False, max_samples: int = 3,
          pipeline: Optional[Any] = None, ops: Optional[Sequence[str]] = None,
          progress: Callable[[str], None] = lambda s: None) -> Report:
    """Runs the sweep on sim:0 in the given mode (sim must be enabled) and returns its report.
    With `pipeline`, every sim op runs inside ``with tp.pipeline(pipeline)`` (automatic
    synchronization orders it against the sample's producers and the CPU reads)."""
    import torch_pipeline as tp
    import torch_pipeline.sim as sim
    from torch.testing._internal.common_methods_invocations import op_db

    sim.set_asynchronous(asynchronous)
    sim.set_strict(False)
    sim.clear_races()
    mode = ("asynchronous" if asynchronous else "synchronous") + (" in a pipeline" if pipeline else "")
    report = Report(mode=mode)
    start = time.monotonic()
    scope = (lambda: tp.pipeline(pipeline)) if pipeline is not None else contextlib.nullcontext
    for op in op_db:
        name = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        if ops is not None and name not in ops:
            continue
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            key = f"{name} {str(dtype).replace('torch.', '')}"
            grad = op.supports_autograd and (dtype.is_floating_point or dtype.is_complex) and \
                dtype in op.supported_backward_dtypes("cpu")
            try:
                torch.manual_seed(0)
                samples = []
                for s in op.sample_inputs("sim:0", dtype, requires_grad=grad):
                    samples.append(s)
                    if len(samples) == max_samples:
                        break
            except Exception:  # noqa: BLE001 - sparse layouts and the like: sim is strided only
                continue
            compared = 0
            for s in samples:
                ref = _cpu_sample(s)
                whats = ["forward"]
                if grad:
                    whats.append("backward")
                if grad and op.supports_forward_ad and dtype != torch.bfloat16 \
                        and dtype != torch.float16:
                    whats.append("forward_ad")
                for what in whats:
                    try:
                        with warnings.catch_warnings(record=True) as cpu_warnings:
                            warnings.simplefilter("always")
                            expected = _run(op, ref, what)
                        if what == "forward" and any(
                                isinstance(t, torch.Tensor) and t.layout != torch.strided
                                for t in _tree(expected)[0]):
                            break  # sparse results: sim is strided only
                        again = _run(op, _cpu_sample(s), what)
                    except Exception:  # noqa: BLE001 - fails on the CPU too
                        break
                    if expected is None:
                        continue
                    if same(again, expected) is not None and op.name not in ADDRESS_DEPENDENT:
                        report.not_reproducible += 1
                        continue
                    try:
                        with scope(), warnings.catch_warnings(record=True) as sim_warnings:
                            warnings.simplefilter("always")
                            got = _run(op, s, what)
                    except Exception as e:  # noqa: BLE001
                        report.sim_only[f"{key} {what}"] = \
                            f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                        break
                    extra = {str(w.message) for w in sim_warnings
                             if not str(w.message).startswith(tuple(WARNS_ONCE))} - \
                        {str(w.message) for w in cpu_warnings}
                    if extra:
                        report.warns[f"{key} {what}"] = sorted(extra)[0][:300]
                    if name in DEVICE_BRANCHES and what in DEVICE_BRANCHES[name][0]:
                        try:
                            torch.testing.assert_close(got, expected, equal_nan=True,
                                                       atol=1e-2, rtol=1e-2, check_device=False,
                                                       check_dtype=False)
                            why = None
                            report.branches[key] = max(report.branches.get(key, 0.0),
                                                       _max_difference(got, expected))
                        except AssertionError as e:
                            why = str(e).splitlines()[0]
                    elif op.name in ADDRESS_DEPENDENT:
                        try:
                            torch.testing.assert_close(got, expected, equal_nan=True, atol=1e-5,
                                                       rtol=1e-4, check_device=False)
                            why = None
                        except AssertionError as e:
                            why = str(e).splitlines()[0]
                    else:
                        why = same(got, expected)
                    if why is not None:
                        report.differ[f"{key} {what}"] = why
                        break
                    if what == "forward":
                        report.samples += 1
                        compared += 1
                    elif what == "backward":
                        report.backward += 1
                    else:
                        report.forward_ad += 1
            if compared:
                report.pairs += 1
        progress(name)
    torch.accelerator.synchronize()
    report.races = len(sim.races())
    sim.clear_races()
    report.seconds = time.monotonic() - start
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--dtypes", default=",".join(str(d).replace("torch.", "") for d in DTYPES))
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--ops", default=None, help="comma-separated OpInfo names")
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args(argv)
    import torch_pipeline as tp
    import torch_pipeline.sim as sim

    sim.enable(1)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    p = tp.Pipeline() if args.pipeline else None
    report = sweep(dtypes, args.asynchronous, args.samples, pipeline=p,
                   ops=args.ops.split(",") if args.ops else None)
    print(report.line())
    for k, v in sorted(report.differ.items()):
        print(f"  differ    {k}: {v}")
    for k, v in sorted(report.sim_only.items()):
        print(f"  sim only  {k}: {v}")
    for k, v in sorted(report.branches.items()):
        print(f"  device branch (to rounding) {k}: max abs difference {v:.3g}")
    return 0 if not (report.differ or report.sim_only or report.races) else 1


if __name__ == "__main__":
    sys.exit(main())
