"""The sim device: a simulated accelerator that detects stream races (docs/design.md,
"The sim device").

PyTorch's PrivateUse1 backend, renamed ``"sim"``, written in C++ (``csrc/sim``): devices
``sim:0 .. sim:N-1`` over host memory, an allocator that caches and reuses blocks per stream like
CUDA's, streams (pools, priorities, ``torch.Stream()``), events, and every aten op run eagerly by
its CPU kernel on the host memory. Each stream and the host carry a vector clock; every read and
write of every op is checked against earlier conflicting accesses of the same bytes, and so is the
reuse of a freed block. Nothing is registered with PyTorch until :func:`enable` runs::

    import torch
    import torch_pipeline.sim as sim

    sim.enable(num_devices=2)
    x = torch.ones(4, device="sim:0")        # default stream of sim:0
    s = torch.Stream(device="sim:0")
    with s:                                  # s.wait_stream(torch.accelerator.current_stream())
        y = x * 2                            # is missing: this read races with ones' write
    print(sim.races()[0])                    # names both ops, their streams and the storage
    sim.clear_races()
    sim.set_strict(True)                     # from now on the racing op raises sim.RaceError

Copies with pinned host memory (``pin_memory()``, ``x.to("cpu", non_blocking=True)``) are
checked on the host side too: until the host synchronizes with the copy's stream, a CPU op that
reads the result of a non_blocking copy to the host, or overwrites the source of one from the
host, is reported as a race of the ``"host"`` timeline (recorded, not raised in strict mode).

By default kernels run when their op is called (the sim models ordering, not time). In
asynchronous mode (``enable(..., asynchronous=True)``, :func:`set_asynchronous`) each stream has a
queue run by a thread of its own, and a latency model (:func:`set_latency`) makes kernels take
time, so a missing wait gives wrong values, as on a GPU::

    sim.set_asynchronous(True)
    sim.set_latency(op="aten::mul.out", us=20_000)   # x * 2 takes 20 ms on its stream
    y = x * 2                                        # returns at once
    with s:
        z = y + 1                                    # no wait: reads y before it is written

Once enabled, ``sim`` is ``torch.accelerator``'s device for the rest of the process (PyTorch
allows one PrivateUse1 backend per process, renamed once), so enable it only where wanted: in a
test process, or before any code that picks "the accelerator". Enable it before the first
``backward()`` of the process: the autograd engine sizes its device queues once, at the first
backward, and a backward on sim after one that ran before enable() fails inside PyTorch.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _C
from ._as_cuda import as_cuda
from ._graph import Graph, graph
from ._report import RaceReport, group_races, name_module_storages, report
from ._trace import trace

__all__ = [
    "DeviceIndexError",
    "Graph",
    "Race",
    "RaceError",
    "RaceReport",
    "as_cuda",
    "clear_latency",
    "clear_races",
    "current_device",
    "current_stream",
    "default_stream",
    "device_count",
    "empty_host_cache",
    "enable",
    "graph",
    "group_races",
    "init",
    "host_memory_stats",
    "is_available",
    "is_asynchronous",
    "is_enabled",
    "is_strict",
    "latency",
    "races",
    "report",
    "report_stacks",
    "set_asynchronous",
    "set_device",
    "set_latency",
    "set_report_stacks",
    "set_stream",
    "set_strict",
    "synchronize",
    "trace",
]

Race = _C.SimRace
Race.__module__ = __name__
Race.__name__ = "Race"
Race.__qualname__ = "Race"

RaceError = _C.SimRaceError
"""Raised in strict mode by the op that races (a ``RuntimeError`` subclass)."""

DeviceIndexError = _C.SimDeviceIndexError
"""Raised for a sim device index out of range: a ``ValueError`` and, as CUDA raises for an invalid
device ordinal, a ``RuntimeError``."""

DeviceLike = Union[torch.device, str, int, None]

_BACKEND = "sim"
_MAX_DEVICES = 16  # kMaxDevices in csrc/sim/state.h
_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A child forked while another thread held _lock (inside enable()) would find it locked forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def enable(num_devices: int = 2, strict: bool = False, asynchronous: bool = False) -> None:
    """Registers the sim device with PyTorch and makes ``num_devices`` devices.

    Idempotent: a second call with the same ``num_devices`` only sets the strict and asynchronous
    flags; another count is a ``ValueError`` (the count is fixed for the process). Raises
    ``RuntimeError`` when the PrivateUse1 backend was already given to another backend in this
    process. ``asynchronous=True``: see :func:`set_asynchronous`.

        >>> import torch_pipeline.sim as sim
        >>> sim.enable(num_devices=2)
        >>> torch.zeros(3, device="sim:1").device
        device(type='sim', index=1)
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int):
        raise TypeError(f"num_devices must be an int, got {type(num_devices).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if not isinstance(asynchronous, bool):
        raise TypeError(f"asynchronous must be a bool, got {type(asynchronous).__name__}")
    if not 1 <= num_devices <= _MAX_DEVICES:
        raise ValueError(f"num_devices must be in [1, {_MAX_DEVICES}], got {num_devices}")
    with _lock:
        if _C._sim_enabled():
            _C._sim_enable(num_devices, strict)  # ValueError for another count
            _C._sim_set_asynchronous(asynchronous)
            return
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", _BACKEND):
            raise RuntimeError(
                f"cannot enable torch_pipeline.sim: PyTorch's PrivateUse1 backend is already "
                f"renamed to {name!r} in this process (one PrivateUse1 backend per process)"
            )
        _C._sim_enable(num_devices, strict)
        if name != _BACKEND:
            torch.utils.rename_privateuse1_backend(_BACKEND)
        if getattr(torch, _BACKEND, None) is None:
            torch._register_device_module(_BACKEND, sys.modules[__name__])
        if not hasattr(torch.Tensor, "is_" + _BACKEND):
            torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        _C._refresh_accelerator()
        _C._sim_set_asynchronous(asynchronous)
        atexit.register(_at_exit)


def _at_exit() -> None:
    _drain_autograd_device_threads()
    # The streams' threads finish what is queued and stop; from here on the device runs
    # synchronously (tasks still running at exit may use it).
    _C._sim_shutdown_executors()


def _drain_autograd_device_threads() -> None:
    # At interpreter exit an autograd device thread may still hold the last reference to the
    # graph task of the last backward(), whose thread-local state holds a Python object; dropping
    # it after finalization began aborts the process (a PyTorch race that the fast sim device
    # makes likely). One tiny backward per device, run through the engine directly (no Python
    # state captured), waits until each device thread has finished its previous task.
    try:
        strict = is_strict()
        _C._sim_set_strict(False)
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        for i in range(device_count()):
            x = torch.zeros((), device=f"{_BACKEND}:{i}", requires_grad=True)
            y = x * 1
            engine.run_backward((y,), (torch.ones_like(y),), False, False, (), True, True)
        _C._sim_set_strict(strict)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def set_asynchronous(asynchronous: bool) -> None:
    """Asynchronous mode: each sim stream gets a queue that a thread of its own runs in order, and
    ops return once their kernel is queued, as on a GPU. Events, stream and device synchronize,
    ``.item()``, ``.cpu()`` and blocking copies to the host wait like CUDA's; ``non_blocking``
    copies with pinned memory complete later; freed memory is reused at once by the caching
    allocator. So a missing wait gives wrong values, not only a race report (the race checker works
    as before). A kernel that raises on its stream is reported by the next synchronizing call
    (``RuntimeError`` naming the op). Switching it off waits for every queue first.

        >>> sim.set_asynchronous(True)
        >>> sim.set_latency(launch_us=20)      # every kernel takes at least 20 us
        >>> y = x * 2                          # returns at once; y is computed later
        >>> y.sum().item()                     # waits for the stream
    """
    if not isinstance(asynchronous, bool):
        raise TypeError(f"asynchronous must be a bool, got {type(asynchronous).__name__}")
    _require_enabled()
    _C._sim_set_asynchronous(asynchronous)


def is_asynchronous() -> bool:
    """Whether asynchronous mode is on."""
    return bool(_C._sim_asynchronous())


def set_latency(launch_us: Optional[float] = None, bandwidth_gbps: Optional[float] = None, *,
                op: Optional[str] = None, us: Optional[float] = None) -> None:
    """The latency model: a kernel touching ``bytes`` of device memory takes at least
    ``launch_us + bytes / bandwidth_gbps`` (a bandwidth of 0 drops that term); both default to 0.
    With ``op=`` (a full name as race reports show it, e.g. ``"aten::mul.Tensor"``), every kernel
    of that op takes ``us`` microseconds instead (``us=None`` removes the override). In
    asynchronous mode a stream's thread sleeps for the time and then runs the kernel, so its
    results land at its end and streams overlap; in synchronous mode the calling thread sleeps
    after the kernel. Arguments left ``None`` keep their value.

        >>> sim.set_latency(launch_us=10, bandwidth_gbps=100)
        >>> sim.set_latency(op="aten::mul.Tensor", us=20_000)   # a 20 ms producer, for a test
    """
    if op is not None:
        if launch_us is not None or bandwidth_gbps is not None:
            raise ValueError("set_latency: give either op= and us=, or launch_us/bandwidth_gbps")
        _C._sim_set_op_latency(op, -1.0 if us is None else float(us))
        return
    if us is not None:
        raise ValueError("set_latency: us= needs op= (the op whose kernels take that time)")
    _C._sim_set_latency(None if launch_us is None else float(launch_us),
                        None if bandwidth_gbps is None else float(bandwidth_gbps))


def latency() -> Tuple[float, float]:
    """``(launch_us, bandwidth_gbps)`` of the latency model (see :func:`set_latency`)."""
    return tuple(_C._sim_latency())  # type: ignore[return-value]


def clear_latency() -> None:
    """Back to the default model: no launch latency, no bandwidth term, no per-op override."""
    _C._sim_set_latency(0.0, 0.0)
    _C._sim_clear_op_latencies()


def is_enabled() -> bool:
    """Whether :func:`enable` has run in this process."""
    return bool(_C._sim_enabled())


def races() -> List[_C.SimRace]:
    """The races detected since the last :func:`clear_races`, oldest first.

        >>> for race in sim.races():
        ...     print(race)   # race on sim:0 storage 0x... : read by aten::mul.Tensor on ...
    """
    return list(_C._sim_races())


def clear_races() -> None:
    """Forgets the races detected so far (the access history is kept)."""
    _C._sim_clear_races()


def set_strict(strict: bool) -> None:
    """Strict mode: the op that races raises :class:`RaceError` (before its kernel runs where the
    race is seen then); otherwise races are only recorded (see :func:`races`)."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    _C._sim_set_strict(strict)


def is_strict() -> bool:
    """Whether strict mode is on."""
    return bool(_C._sim_strict())


def set_report_stacks(on: bool) -> None:
    """Race reports with the Python stacks of both accesses and the tensor's dtype, shape and name
    (module parameters and buffers, named the first time their module runs): while on, every sim
    op keeps the stack of the thread that called it (2-5 us more per op on a 2-core machine, paid
    only while on; :func:`as_cuda` turns it on). See :func:`report`.

        >>> sim.set_report_stacks(True)
        >>> ...
        >>> sim.races()[0].later_stack[0]      # innermost frame: (file, line, function)
        ('train.py', 42, 'step')
    """
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    _C._sim_set_record_sites(on)
    name_module_storages(on)


def report_stacks() -> bool:
    """Whether races keep the Python stacks of their accesses (:func:`set_report_stacks`)."""
    return bool(_C._sim_record_sites())


def _require_enabled() -> None:
    if not _C._sim_enabled():
        raise RuntimeError("the sim device is not enabled: call torch_pipeline.sim.enable() first")


def _index(device: DeviceLike) -> int:
    if device is None:
        return current_device()
    if isinstance(device, bool):
        raise TypeError("device must be a torch.device, a str, an int or None, got a bool")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return device
    d = torch.device(device)
    if d.type != _BACKEND:
        raise ValueError(f"expected a sim device, got {d}")
    return current_device() if d.index is None else d.index


def synchronize(device: DeviceLike = None) -> None:
    """The host waits for every stream of ``device`` (default: the current sim device).

        >>> sim.synchronize("sim:1")
    """
    _require_enabled()
    _C._sim_synchronize(_index(device))


def host_memory_stats() -> Dict[str, int]:
    """Statistics of the sim's pinned host allocator, under ``torch.cuda.host_memory_stats``'
    names: ``allocations`` and ``allocated_bytes`` count the blocks it holds (in use or cached),
    ``active_requests`` and ``active_bytes`` those in use (each ``.current``, ``.peak``,
    ``.allocated``, ``.freed``); ``num_host_alloc`` / ``num_host_free`` count the blocks taken
    from and given back to the system. A freed pinned block is cached and handed out again;
    ``torch.accelerator.empty_host_cache()`` gives the cached ones back.

        >>> x = torch.empty(1000, pin_memory=True); del x
        >>> y = torch.empty(1000, pin_memory=True)    # the same block again
        >>> sim.host_memory_stats()["num_host_alloc"]
        1
    """
    return dict(_C._sim_host_memory_stats())


def empty_host_cache() -> None:
    """Gives the pinned host allocator's cached blocks back to the system (what
    ``torch.accelerator.empty_host_cache()`` does, on the torch versions that have it).

        >>> x = torch.empty(1000, pin_memory=True); del x
        >>> sim.empty_host_cache()
        >>> sim.host_memory_stats()["allocations.current"]
        0
    """
    _C._sim_empty_host_cache()


def raw_kernel(name: str, read: Sequence[torch.Tensor] = (),
               write: Sequence[torch.Tensor] = ()) -> None:
    """Stands in for a kernel the dispatcher never sees (a raw launch on data pointers): checks and
    records its accesses of the sim tensors ``read`` and ``write`` on the current stream of their
    device, like an op's (strict mode raises :class:`RaceError`). Values are left as they are.
    Pair it with :func:`torch_pipeline.track` to show that declared accesses are synchronized.

        >>> with tp.track(read=[x], write=[y]):
        ...     sim.raw_kernel("my_kernel", read=[x], write=[y])
    """
    _require_enabled()
    _C._sim_raw_kernel(name, list(read), list(write))


# ---- the device module (torch.sim), used by torch's generic device code ------------------------
def is_available() -> bool:
    """Whether the sim device is enabled (torch.sim.is_available)."""
    return is_enabled()


def is_initialized() -> bool:
    return is_enabled()


def _lazy_init() -> None:
    _require_enabled()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """Number of sim devices (0 before :func:`enable`)."""
    return int(_C._sim_num_devices())


def current_device() -> int:
    """The calling thread's current sim device index."""
    _require_enabled()
    return torch.accelerator.current_device_index()


def set_device(device: DeviceLike) -> None:
    """Sets the calling thread's current sim device."""
    _require_enabled()
    torch.accelerator.set_device_index(_index(device))


def current_stream(device: DeviceLike = None) -> torch.Stream:
    """The calling thread's current stream of ``device`` (default: the current sim device)."""
    _require_enabled()
    return torch.accelerator.current_stream(_index(device))


def default_stream(device: DeviceLike = None) -> torch.Stream:
    """The default stream of ``device`` (default: the current sim device), as
    ``torch.cuda.default_stream``.

        >>> torch.sim.default_stream(1).stream_id
        0
    """
    _require_enabled()
    index = _index(device)
    current = torch.accelerator.current_stream(index)
    return torch.Stream(stream_id=0, device_index=index,  # type: ignore[call-arg]
                        device_type=current.device_type)


def init() -> None:
    """Nothing to do once :func:`enable` ran (``torch.cuda.init``'s counterpart); raises
    ``RuntimeError`` before."""
    _require_enabled()


def set_stream(stream: torch.Stream) -> None:
    """Makes ``stream`` the calling thread's current stream of its device."""
    _require_enabled()
    torch.accelerator.set_stream(stream)


class device:
    """Context manager that makes ``device`` the current sim device (like ``torch.cuda.device``).

    Example::

        with torch_pipeline.sim.device(1):
            x = torch.ones(4, device="sim")   # on sim:1
    """

    def __init__(self, device: DeviceLike) -> None:
        self.index = -1 if device is None else _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        if self.index >= 0:
            self.previous = current_device()
            set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.index >= 0:
            set_device(self.previous)


def get_amp_supported_dtype() -> List[torch.dtype]:
    """Data types autocast may use on sim (its kernels are CPU kernels)."""
    return [torch.bfloat16, torch.float16]


def get_rng_state(device: DeviceLike = None) -> torch.Tensor:
    """Random ops on sim draw from the CPU generator: its state (used by activation
    checkpointing to replay dropout)."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: DeviceLike = None) -> None:
    """Restores what :func:`get_rng_state` returned."""
    torch.set_rng_state(new_state)


def manual_seed_all(seed: int) -> None:
    """Seeds the generator that random ops on sim draw from: the CPU's, since they run their CPU
    kernels (so it reseeds the CPU's random numbers too; torch.manual_seed calls it as well).

        >>> torch.sim.manual_seed_all(0)
        >>> a = torch.rand(3, device="sim")
    """
    torch.default_generator.manual_seed(int(seed))


def manual_seed(seed: int) -> None:
    """The same as :func:`manual_seed_all` (every sim device draws from the CPU generator)."""
    manual_seed_all(seed)


# ---- torch.compile ----------------------------------------------------------------------------
_COMPILE_REFUSAL = (
    "torch.compile's default backend (inductor) cannot generate code for the sim device: its "
    "kernels would touch sim memory outside the dispatcher, unseen by the race checker. Compile "
    "with torch.compile(..., backend='aot_eager') (or 'eager'), which runs the traced graph op by "
    "op on sim, checked like eager code."
)
_INDUCTOR_HOOKS = ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")


class _Refusing(type):
    def __getattr__(cls, name: str) -> object:
        raise NotImplementedError(_COMPILE_REFUSAL)


class _InductorRefusal(metaclass=_Refusing):
    """What inductor finds as the sim device's code generators: using one in any way (creating
    it, asking it anything) raises a clear error instead of inductor's ``KeyError: 'sim'``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(_COMPILE_REFUSAL)


def __getattr__(name: str) -> object:
    # Inductor asks the device module (torch.sim) for these the first time it compiles for a
    # PrivateUse1 device; it has then imported its codegen, where the device's op overrides are
    # registered too (looked up before the code generators).
    if name not in _INDUCTOR_HOOKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    common = sys.modules.get("torch._inductor.codegen.common")
    if common is not None and _BACKEND not in common.device_op_overrides_dict:
        common.register_device_op_overrides(_BACKEND, common.DeviceOpOverrides())
    return _InductorRefusal
