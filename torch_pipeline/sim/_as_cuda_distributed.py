"""``torch.distributed`` for a CUDA program run on sim (:func:`torch_pipeline.sim.as_cuda`).

NCCL needs GPUs, so ``init_process_group("nccl")`` makes a Gloo group instead, and the collectives
a program calls on CUDA tensors (:data:`STAGED`) run host-staged *on the current stream*: the
tensor is copied to the host on the current stream (a read there, as NCCL's kernel reads it after
the current stream's work so far), Gloo runs the collective on the copy, and the result is copied
back on the current stream (a write there). So a collective on a side stream that does not wait
for the stream that wrote its input (the gradients of a backward) is reported like any other
race, with both lines. ``async_op=True`` returns a finished work whose ``wait()`` orders the
stream current at the wait after the copy back, as NCCL's does.

What is not mapped: collectives called through a ``ProcessGroup`` object or from C++ (DDP's
reducer, FSDP), object collectives, point-to-point ops; ``dist.get_backend()`` says ``"gloo"``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import _as_cuda  # (which imports this module first: its names are used at calls only)

_SIM = "sim"

# The collectives staged through the host (name -> how its tensors are passed).
STAGED: Dict[str, str] = {
    "all_reduce": "in place",
    "broadcast": "in place",
    "reduce": "in place",
    "all_gather_into_tensor": "output, input",
    "reduce_scatter_tensor": "output, input",
}


class _Finished:
    """The work of a staged collective with ``async_op=True``: done on the host, its copy back
    queued on the stream that was current at the call."""

    def __init__(self, stream: torch.Stream) -> None:
        self._event = torch.Event(device=stream.device)
        self._event.record(stream)

    def wait(self, timeout: Optional[Any] = None) -> bool:
        # (as ProcessGroupNCCL's Work.wait: the current stream waits for the collective)
        torch.accelerator.current_stream(self._event.device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def is_success(self) -> bool:
        return True

    def get_future(self) -> "torch.futures.Future[Any]":
        future: "torch.futures.Future[Any]" = torch.futures.Future()
        future.set_result(None)
        return future


def _on_sim(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and _as_cuda._real_device(t).type == _SIM


def _staged(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    two = STAGED[name] == "output, input"
    # (the tensors are the first parameters, whatever torch calls them)
    names = tuple(signature.parameters)[:2 if two else 1]

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        tensors: List[torch.Tensor] = [bound.arguments[n] for n in names]
        if not any(_on_sim(t) for t in tensors):
            return original(*args, **kwargs)
        async_op = bool(bound.arguments.get("async_op", False))
        bound.arguments["async_op"] = False
        stream = torch.accelerator.current_stream(_as_cuda._real_device(tensors[0]))
        if two:
            output, input_ = tensors
            host_out = torch.empty(output.shape, dtype=output.dtype)
            bound.arguments[names[0]] = host_out
            bound.arguments[names[1]] = input_.to("cpu")  # read on the current stream
            original(*bound.args, **bound.kwargs)
            output.copy_(host_out)  # written on the current stream
        else:
            (tensor,) = tensors
            host = tensor.to("cpu")  # read on the current stream
            bound.arguments[names[0]] = host
            original(*bound.args, **bound.kwargs)
            tensor.copy_(host)  # written on the current stream
        return _Finished(stream) if async_op else None

    return collective


def _init_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(original).bind(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if isinstance(backend, str) and "nccl" in backend.lower():
            bound.arguments["backend"] = "gloo"
        device_id = bound.arguments.get("device_id")
        if device_id is not None and not (isinstance(device_id, torch.device)
                                          and device_id.type == "cpu"):
            bound.arguments["device_id"] = None  # (Gloo binds no device)
        original(*bound.args, **bound.kwargs)

    return init_process_group


def install() -> Dict[str, Any]:
    """Replaces what this module maps in ``torch.distributed``; returns what it replaced."""
    if not dist.is_available():
        return {}
    saved: Dict[str, Any] = {"init_process_group": dist.init_process_group,
                             "is_nccl_available": dist.is_nccl_available}
    dist.init_process_group = _init_process_group(dist.init_process_group)
    dist.is_nccl_available = lambda: True
    for name in STAGED:
        saved[name] = getattr(dist, name)
        setattr(dist, name, _staged(name, saved[name]))
    return saved


def uninstall(saved: Dict[str, Any]) -> None:
    """Puts back what :func:`install` replaced."""
    for name, value in saved.items():
        setattr(dist, name, value)
