"""Compiled regions (``torch.compile``) tracked as ops.

Inductor's kernels (Triton on GPUs, C++ on CPUs) are launched without a dispatcher op, so the
tracker's RecordFunction observer cannot see them. Every backend built on AOTAutograd (the default
``inductor``, ``aot_eager``, custom ``aot_autograd(...)`` backends) calls its compiled functions
from ``torch._functorch._aot_autograd.runtime_wrappers``: backward through the helper
``call_func_at_runtime_with_args`` (PyTorch 2.8-2.14), forward and inference through that helper
before 2.13 and through the runtime wrapper that ``_create_runtime_wrapper`` makes from 2.13 on.
Both are wrapped; each call is a ``CompiledRegion`` (csrc/runtime/tracking.h): one op on the
current streams that reads and writes every flat argument (parameters and buffers lifted to
inputs, user inputs, saved tensors in backward) and writes its outputs; the dispatcher ops it calls
are not tracked again.

The wrap is installed when that module is imported (an import hook: importing torch_pipeline does
not import torch._functorch), and only changes anything while tracking is live. Where it cannot be
installed, a compiled region in which nothing was tracked is counted
(``tracking_stats()["compiled_unwrapped"]``) and warned about once.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, List, Optional, Sequence

import torch

from . import _C

__all__: List[str] = []

_MODULE = "torch._functorch._aot_autograd.runtime_wrappers"
# The calls of compiled code there: the helper that calls backward (all versions) and forward or
# inference (before 2.13), and the factory of the runtime wrapper that calls forward or inference
# (2.13 on: code generated per graph, which no longer calls the helper).
_HELPER = "call_func_at_runtime_with_args"
_FACTORY = "_create_runtime_wrapper"
_lock = threading.Lock()
_enabled = True  # test switch: False leaves compiled regions untracked (tests show the race)


def _region(call: Callable[..., Any], args: Sequence[Any], *rest: Any, **kwargs: Any) -> Any:
    """call(args, *rest, **kwargs) as a CompiledRegion over the tensors of ``args``."""
    if not _enabled or not _C._tracking_live():
        return call(args, *rest, **kwargs)
    region = _C._CompiledRegion([a for a in args if isinstance(a, torch.Tensor)])
    try:
        out = call(args, *rest, **kwargs)
        if isinstance(out, (list, tuple)):
            region.outputs([o for o in out if isinstance(o, torch.Tensor)])
        return out
    finally:
        region.close()  # (a traceback may keep `region` alive: end it here)


def _tracked_helper(original: Callable[..., List[Any]]) -> Callable[..., List[Any]]:
    @functools.wraps(original)
    def call_func_at_runtime_with_args(f: Callable[..., Any], args: Sequence[Any],
                                       *rest: Any, **kwargs: Any) -> List[Any]:
        return _region(lambda a, *r, **k: original(f, a, *r, **k), args, *rest, **kwargs)

    call_func_at_runtime_with_args._tp_tracked = True  # type: ignore[attr-defined]
    return call_func_at_runtime_with_args


def _tracked_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_runtime_wrapper(*a: Any, **k: Any) -> Any:
        runtime_wrapper = original(*a, **k)

        @functools.wraps(runtime_wrapper)
        def tracked_runtime_wrapper(args: Sequence[Any], *rest: Any, **kwargs: Any) -> Any:
            return _region(runtime_wrapper, args, *rest, **kwargs)

        return tracked_runtime_wrapper

    create_runtime_wrapper._tp_tracked = True  # type: ignore[attr-defined]
    return create_runtime_wrapper


def _wrap(module: ModuleType) -> bool:
    with _lock:
        helper = getattr(module, _HELPER, None)
        if helper is None or not callable(helper):
            warnings.warn(
                f"torch_pipeline: {_MODULE}.{_HELPER} is missing in torch {torch.__version__}, "
                "so compiled regions (torch.compile) are not tracked as ops; a region in which "
                "nothing was tracked is warned about when it runs. Declare such a region's "
                "tensors with tp.track(read=..., write=...).", UserWarning, stacklevel=2)
            return False
        if not getattr(helper, "_tp_tracked", False):
            setattr(module, _HELPER, _tracked_helper(helper))
        factory = getattr(module, _FACTORY, None)
        if callable(factory) and not getattr(factory, "_tp_tracked", False):
            setattr(module, _FACTORY, _tracked_factory(factory))
        _C._set_regions_wrapped(True)
        return True


class _Finder(importlib.abc.MetaPathFinder):
    """Calls ``after(module)`` right after the module ``name`` is first imported."""

    def __init__(self, name: str, after: Callable[[ModuleType], Any]) -> None:
        self.name = name
        self.after = after

    def find_spec(self, fullname: str, path: Any, target: Optional[ModuleType] = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # (find the real spec without this finder)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        after = self.after

        def exec_and_wrap(module: ModuleType) -> None:
            exec_module(module)
            after(module)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def _when_imported(name: str, after: Callable[[ModuleType], Any]) -> None:
    """``after(module)`` now if ``name`` is imported, else right after its first import."""
    module = sys.modules.get(name)
    if module is not None:
        after(module)
    elif not any(isinstance(f, _Finder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, after))


def install() -> None:
    """Wraps the helper now if its module is loaded, else when it is first imported; tells the
    tracker when torch._dynamo is imported (from then on a compiled region can run: while regions
    are not wrapped, it checks Dynamo's ranges, which costs every op a RecordFunction)."""
    _when_imported(_MODULE, _wrap)
    _when_imported("torch._dynamo", lambda _: _C._set_dynamo_loaded())


install()
