"""Running a program written for CUDA on the sim device (:func:`as_cuda`).

Four parts, installed together and removed together:

- a ``TorchFunctionMode`` that maps CUDA devices in the calls the program makes (``device="cuda"``,
  ``.cuda()``, ``.to("cuda:1")``) to sim devices, and answers the program's own questions about
  its tensors as CUDA would (``x.is_cuda``, ``x.device.type == "cuda"``). The mode is per thread:
  threads started while it is installed (``threading``, ``concurrent.futures``) get it too.
  Inside a torch function (its implementation, its kernels) devices are the real ``sim`` ones;
- the ``torch.cuda`` functions and classes a stream program uses, replaced by sim ones
  (:data:`MAPPED`); everything else of ``torch.cuda`` is left as it is, so on a CPU build of torch
  it raises torch's own "Torch not compiled with CUDA enabled" instead of answering wrongly;
- ``torch.autocast("cuda")`` (and ``torch.cuda.amp.autocast``) as ``torch.autocast("sim")``;
- ``torch.distributed``'s NCCL as Gloo, the collectives on CUDA tensors staged through the host
  on the current stream (``_as_cuda_distributed``).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch
from torch.overrides import TorchFunctionMode

from .. import _C
from . import _as_cuda_distributed

_SIM = "sim"
_CUDA = "cuda"

DeviceLike = Union[torch.device, str, int, None]

# What as_cuda() maps, for the documentation and for tests (name under torch.cuda -> what it does).
MAPPED: Dict[str, str] = {
    "is_available": "True",
    "is_initialized": "True",
    "init": "nothing to do",
    "device_count": "the number of sim devices",
    "current_device": "the current sim device",
    "set_device": "sets the current sim device",
    "device": "context manager: the current sim device inside",
    "device_of": "context manager: the device of a tensor",
    "synchronize": "the host waits for every stream of the device",
    "Stream": "a sim stream (a torch.Stream); priority as on CUDA (priority_range() is (0, -3)), "
              "from a pool of 32 per priority per device handed out round robin as CUDA's: one "
              "that is the same stream as a live one made elsewhere is warned about with both "
              "lines; its device and repr say cuda:i",
    "Event": "a sim event (a torch.Event); elapsed_time from the latency model",
    "stream": "context manager: the stream is current inside",
    "StreamContext": "the same, as a class",
    "current_stream": "the current sim stream",
    "default_stream": "the default sim stream",
    "set_stream": "makes the stream current",
    "get_device_name": "'torch_pipeline sim'",
    "get_device_capability": "(9, 0) (a documented approximation: sim runs every op)",
    "is_bf16_supported": "True",
    "manual_seed": "seeds the generator sim ops draw from (the CPU's)",
    "manual_seed_all": "the same",
    "get_rng_state": "that generator's state (the CPU's: sim ops draw from it)",
    "set_rng_state": "sets it",
    "get_rng_state_all": "its state, once per device",
    "set_rng_state_all": "sets it from the first",
    "memory_allocated": "the sim allocator's bytes in use",
    "max_memory_allocated": "its peak",
    "memory_reserved": "the bytes it holds",
    "max_memory_reserved": "their peak",
    "memory_stats": "the sim allocator's statistics (the CUDA caching allocator's keys)",
    "mem_get_info": "(free, total) bytes of the sim device",
    "empty_cache": "gives the cached blocks back",
    "reset_peak_memory_stats": "resets the peaks",
    "reset_accumulated_memory_stats": "resets the accumulated counts",
    "caching_allocator_alloc": "a block of the sim allocator (device, stream), as its address",
    "caching_allocator_delete": "frees a block caching_allocator_alloc returned",
    "host_memory_stats": "the pinned host allocator's statistics",
}

# The names above that torch.cuda.memory defines too (as_cuda replaces them there as well).
_MEMORY_NAMES = frozenset({
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_stats", "mem_get_info", "empty_cache", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "caching_allocator_alloc", "caching_allocator_delete",
    "host_memory_stats"})

# The sim's stream priorities (csrc/sim/state.h: kLowestPriority, kHighestPriority).
_LOWEST_PRIORITY, _HIGHEST_PRIORITY = 0, -3


def _sim_device(device: DeviceLike) -> torch.device:
    """The sim device for a CUDA (or sim) device argument; None: the current sim device."""
    if device is None:
        return torch.device(_SIM, torch.accelerator.current_device_index())
    if isinstance(device, bool):
        raise TypeError("device must be a torch.device, a str or an int, got a bool")
    if isinstance(device, int):
        return torch.device(_SIM, device)
    if isinstance(device, _DeviceScope):  # torch.cuda.device(i), as CUDA's _get_device_index
        return torch.device(_SIM, device.idx) if device.idx >= 0 else _sim_device(None)
    d = torch.device(device)
    if d.type not in (_CUDA, _SIM):
        raise ValueError(f"Expected a cuda device, but got: {d}")  # CUDA's words
    index = torch.accelerator.current_device_index() if d.index is None else d.index
    return torch.device(_SIM, index)


def _index(device: DeviceLike) -> int:
    index = _sim_device(device).index
    assert index is not None
    count = _C._sim_num_devices()
    if not 0 <= index < count:
        # CUDA raises RuntimeError ("invalid device ordinal") here; so does this.
        raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of a program run "
                           f"on {count} sim device(s): give --devices / as_cuda(devices=...))")
    return index


def _to_sim(value: Any) -> Any:
    """A device argument mapped to sim: CUDA devices and strings naming one; other values as is."""
    if isinstance(value, torch.device):
        return _sim_device(value) if value.type == _CUDA else value
    if isinstance(value, str) and (value == _CUDA or value.startswith(_CUDA + ":")):
        return _sim_device(value)
    return value


def _cuda_view(device: torch.device) -> torch.device:
    return torch.device(_CUDA, device.index) if device.type == _SIM else device


_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
# A property's getter reaches the mode as a new method-wrapper each time: compared with ==.
_IS_CUDA_GET = torch._C.TensorBase.is_cuda.__get__  # type: ignore[attr-defined]
_DEVICE_GET = torch._C.TensorBase.device.__get__


_STREAM_DEVICE_GET = torch.Stream.device.__get__  # type: ignore[attr-defined]


def _mode_is_on() -> bool:
    """Whether the calling thread runs under the mode (not inside a torch function it handles)."""
    return any(isinstance(m, _CudaOnSim)
               for m in torch.overrides._get_current_function_mode_stack())


def _real_device(t: torch.Tensor) -> torch.device:
    """The tensor's own device: outside a torch function the mode shows the program "cuda"."""
    with torch._C.DisableTorchFunction():
        return t.device


class _CudaOnSim(TorchFunctionMode):
    """Maps CUDA devices to sim ones in the calls it sees (the program's own)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func == _IS_CUDA_GET:
            return func(*args) or _DEVICE_GET(args[0]).type == _SIM
        if func == _DEVICE_GET:
            return _cuda_view(func(*args))
        if func is _TENSOR_CUDA:
            tensor = args[0]
            device = args[1] if len(args) > 1 else kwargs.pop("device", None)
            non_blocking = args[2] if len(args) > 2 else kwargs.pop("non_blocking", False)
            return _TENSOR_TO(tensor, _sim_device(device), non_blocking=non_blocking, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = _to_sim(kwargs["device"])
        if func is _TENSOR_TO and len(args) > 1:
            args = (args[0], _to_sim(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class Stream(torch.Stream):
    """``torch.cuda.Stream`` on sim: a ``torch.Stream`` of a sim device.

        >>> s = torch.cuda.Stream()          # inside as_cuda()
        >>> with torch.cuda.stream(s):
        ...     y = x * 2
    """

    def __new__(cls, device: DeviceLike = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)  # type: ignore[call-arg]
        stream = super().__new__(cls, _sim_device(device), priority=priority)  # type: ignore[call-arg]
        _note_new_stream(stream)
        return stream

    @classmethod
    def _of(cls, stream: torch.Stream) -> "Stream":
        return cls(stream_id=stream.stream_id, device_index=stream.device_index,
                   device_type=stream.device_type)

    @property
    def cuda_stream(self) -> int:
        """An integer that identifies the stream (CUDA's is the cudaStream_t; here its id)."""
        return int(self.stream_id)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The stream's device as the program sees it: ``cuda:i`` where the mode is on, like its
        tensors' (``sim:i`` elsewhere, e.g. in backward functions on autograd's threads, which
        move tensors to it)."""
        device = _STREAM_DEVICE_GET(self)
        return _cuda_view(device) if _mode_is_on() else device

    @staticmethod
    def priority_range() -> Tuple[int, int]:
        """``(lowest, highest)`` priority, as ``torch.cuda.Stream.priority_range()``."""
        return _LOWEST_PRIORITY, _HIGHEST_PRIORITY

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x}>"

    @property
    def priority(self) -> int:  # type: ignore[override]
        """The stream's priority (0 or negative: lower is higher, as on CUDA)."""
        return int(_C._sim_stream_priority(self))

    def record_event(self, event: Optional[torch.Event] = None) -> torch.Event:  # type: ignore[override]
        if event is None:
            event = Event()
        event.record(self)
        return event


# Note [Stream aliases]: CUDA's torch.cuda.Stream() hands out the streams of a pool, 32 per
# priority per device, round robin; the 33rd is the 1st again. Code that keeps more than 32 streams
# alive gets two handles on one stream without knowing: their work is serialized and a wait of one
# for the other does nothing. The sim pool is the same, so the run mode can say where: each new
# stream is remembered (weakly) with the program's line that made it, and one that is the same
# stream as a live one made at another call is warned about once per pair of lines.
_made: Dict[Tuple[int, int], Tuple["weakref.ref[Stream]", Tuple[str, int, str]]] = {}
_aliases: List[str] = []
_aliases_warned: Set[Tuple[Tuple[str, int, str], Tuple[str, int, str]]] = set()
_made_lock = threading.Lock()


def _program_frame() -> Tuple[str, int, str]:
    """The innermost frame of the program's own code (not torch's, torch_pipeline's or the
    standard library's) on this thread."""
    from ._report import _is_user_frame

    f: Optional[types.FrameType] = sys._getframe(2)
    first: Optional[Tuple[str, int, str]] = None
    while f is not None:
        frame = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        first = first or frame
        if _is_user_frame(frame):
            return frame
        f = f.f_back
    return first or ("?", 0, "?")


def _note_new_stream(stream: "Stream") -> None:
    key = (int(stream.device_index), int(stream.stream_id))
    here = _program_frame()
    with _made_lock:
        earlier = _made.get(key)
        _made[key] = (weakref.ref(stream), here)
        if earlier is None or earlier[0]() is None:
            return
        there = earlier[1]
        if (there, here) in _aliases_warned:
            return
        _aliases_warned.add((there, here))
        message = (
            f"torch.cuda.Stream() at {here[0]}:{here[1]} in {here[2]} returned the same stream as "
            f"the one made at {there[0]}:{there[1]} in {there[2]}, which is still alive "
            f"(cuda:{key[0]}, stream {key[1]}): CUDA hands out 32 streams per priority per "
            f"device, round robin, so the 33rd aliases the 1st. Work on the two is serialized and "
            f"a wait of one for the other does nothing. Keep at most 32 streams per priority "
            f"alive (reuse them), or use torch_pipeline pipelines, whose streams are never "
            f"shared by live handles.")
        _aliases.append(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def stream_aliases() -> List[str]:
    """What :func:`_note_new_stream` warned about so far (Note [Stream aliases])."""
    with _made_lock:
        return list(_aliases)


def _forget_streams() -> None:
    with _made_lock:
        _made.clear()
        _aliases.clear()
        _aliases_warned.clear()


class _EventType(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Event) and obj.device is not None and \
            torch.device(obj.device).type == _SIM


class Event(metaclass=_EventType):
    """``torch.cuda.Event`` on sim: makes a ``torch.Event`` of the sim device (``elapsed_time``
    from the latency model in asynchronous mode). Not a subclass: ``torch.Event`` methods accept
    only ``torch.Event`` itself as their other event; ``isinstance(e, torch.cuda.Event)`` holds."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,  # type: ignore[misc]
                interprocess: bool = False) -> torch.Event:
        if interprocess:
            raise NotImplementedError("torch.cuda.Event(interprocess=True) is not simulated: sim "
                                      "devices live in one process")
        return torch.Event(device=_SIM, enable_timing=enable_timing, blocking=blocking)


class StreamContext:
    """``torch.cuda.stream(s)``: ``s`` is the current stream of its device inside (None: no-op)."""

    def __init__(self, stream: Optional[torch.Stream]) -> None:
        self.stream = stream
        self._previous: List[Tuple[torch.Stream, torch.Stream]] = []

    def __enter__(self) -> Optional[torch.Stream]:
        # As torch.cuda.StreamContext: setting a stream makes its device current, and on exit the
        # stream's device gets its previous stream back, then the previous device its own.
        if self.stream is not None:
            here = torch.accelerator.current_stream()
            there = torch.accelerator.current_stream(self.stream.device_index)
            self._previous.append((here, there))
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            here, there = self._previous.pop()
            torch.accelerator.set_stream(there)
            torch.accelerator.set_stream(here)


class _DeviceScope:
    def __init__(self, device: DeviceLike) -> None:
        self.index = -1 if device is None or (isinstance(device, int) and device < 0) \
            else _index(device)
        self.previous = -1

    @property
    def idx(self) -> int:
        """The device index (-1: no device), as ``torch.cuda.device(...).idx``."""
        return self.index

    def __enter__(self) -> None:
        if self.index >= 0:
            self.previous = torch.accelerator.current_device_index()
            torch.accelerator.set_device_index(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.index >= 0:
            torch.accelerator.set_device_index(self.previous)


def _device_of(tensor: torch.Tensor) -> _DeviceScope:
    d = _real_device(tensor)
    return _DeviceScope(d if d.type == _SIM else None)


def _current_stream(device: DeviceLike = None) -> Stream:
    return Stream._of(torch.accelerator.current_stream(_index(device)))


def _default_stream(device: DeviceLike = None) -> Stream:
    from . import default_stream

    return Stream._of(default_stream(_index(device)))


def _synchronize(device: DeviceLike = None) -> None:
    _C._sim_synchronize(_index(device))


# Blocks handed out by caching_allocator_alloc, by address, until caching_allocator_delete.
_raw_blocks: Dict[int, torch.Tensor] = {}
_raw_lock = threading.Lock()


def _caching_allocator_alloc(size: int, device: DeviceLike = None,
                             stream: Union[torch.Stream, int, None] = None) -> int:
    index = _index(device)
    if stream is None:
        stream = torch.accelerator.current_stream(index)
    elif isinstance(stream, int):  # CUDA's takes a cudaStream_t; here a cuda_stream (its id)
        stream = torch.Stream(stream_id=stream, device_index=index,  # type: ignore[call-arg]
                              device_type=torch.accelerator.current_stream(index).device_type)
    elif not isinstance(stream, torch.Stream):
        raise TypeError("Invalid type for stream argument, must be `torch.cuda.Stream` or `int` "
                        "representing a pointer to an existing stream")
    with torch.accelerator.device_index(index), stream:
        block = torch.empty(int(size), dtype=torch.uint8, device=torch.device(_SIM, index))
    with _raw_lock:
        _raw_blocks[block.data_ptr()] = block
    return block.data_ptr()


def _caching_allocator_delete(mem_ptr: int) -> None:
    with _raw_lock:
        block = _raw_blocks.pop(int(mem_ptr), None)
    if block is None:
        raise RuntimeError(f"caching_allocator_delete: {int(mem_ptr):#x} is not a block that "
                           f"torch.cuda.caching_allocator_alloc returned (invalid device pointer)")


def _replacements() -> Dict[str, Any]:
    acc = torch.accelerator
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "_lazy_init": lambda: None,
        "device_count": lambda: int(_C._sim_num_devices()),
        "current_device": lambda: acc.current_device_index(),
        "set_device": lambda device: acc.set_device_index(_index(device)),
        "device": _DeviceScope,
        "device_of": _device_of,
        "synchronize": _synchronize,
        "Stream": Stream,
        "Event": Event,
        "stream": StreamContext,
        "StreamContext": StreamContext,
        "current_stream": _current_stream,
        "default_stream": _default_stream,
        "set_stream": lambda stream: acc.set_stream(stream),
        "get_device_name": lambda device=None: "torch_pipeline sim",
        "get_device_capability": lambda device=None: (9, 0),
        "is_bf16_supported": lambda including_emulation=True: True,
        # torch.manual_seed calls torch.cuda.manual_seed_all: these seed the CPU generator
        # only (sim ops draw from it), as torch.sim.manual_seed_all does.
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "get_rng_state_all": lambda: [torch.get_rng_state()] * int(_C._sim_num_devices()),
        "set_rng_state_all": lambda new_states: torch.set_rng_state(list(new_states)[0]),
        "memory_allocated": lambda device=None: acc.memory_allocated(_index(device)),
        "max_memory_allocated": lambda device=None: acc.max_memory_allocated(_index(device)),
        "memory_reserved": lambda device=None: acc.memory_reserved(_index(device)),
        "max_memory_reserved": lambda device=None: acc.max_memory_reserved(_index(device)),
        "memory_stats": lambda device=None: acc.memory_stats(_index(device)),
        "mem_get_info": lambda device=None: acc.get_memory_info(_index(device)),
        "empty_cache": lambda: acc.empty_cache(),
        "reset_peak_memory_stats": lambda device=None: acc.reset_peak_memory_stats(_index(device)),
        "reset_accumulated_memory_stats":
            lambda device=None: acc.reset_accumulated_memory_stats(_index(device)),
        "caching_allocator_alloc": _caching_allocator_alloc,
        "caching_allocator_delete": _caching_allocator_delete,
        "host_memory_stats": lambda: dict(_C._sim_host_memory_stats()),
    }


_AUTOCAST_INIT = torch.amp.autocast_mode.autocast.__init__


def _autocast_init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
    _AUTOCAST_INIT(self, _SIM if device_type == _CUDA else device_type, *args, **kwargs)


_BOOTSTRAP_INNER = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _bootstrap_inner(self: threading.Thread) -> None:
    # Threads started while as_cuda() is installed run their target under the mode too.
    if _installed is None:
        _BOOTSTRAP_INNER(self)
        return
    with _CudaOnSim():
        _BOOTSTRAP_INNER(self)


class _Installed:
    def __init__(self) -> None:
        self.saved: Dict[str, Any] = {}
        self.saved_memory: Dict[str, Any] = {}  # torch.cuda.memory's own names
        self.saved_distributed: Dict[str, Any] = {}
        self.mode = _CudaOnSim()


_installed: Optional[_Installed] = None
_install_lock = threading.Lock()


def install() -> None:
    """Installs the mapping for the calling thread and threads started from now on (see
    :func:`as_cuda`); the sim device must be enabled."""
    global _installed
    with _install_lock:
        if _installed is not None:
            raise RuntimeError("torch_pipeline.sim.as_cuda() is already installed in this process")
        if not _C._sim_enabled():
            raise RuntimeError("the sim device is not enabled: call torch_pipeline.sim.enable()")
        state = _Installed()
        memory = sys.modules.get("torch.cuda.memory")
        for name, value in _replacements().items():
            state.saved[name] = torch.cuda.__dict__.get(name, _MISSING)
            setattr(torch.cuda, name, value)
            # torch.cuda.memory.empty_cache() and the like are the same functions under their
            # module's name: left alone, they would find CUDA uninitialized and answer 0 or {}.
            if memory is not None and name in _MEMORY_NAMES and name in memory.__dict__:
                state.saved_memory[name] = memory.__dict__[name]
                setattr(memory, name, value)
        torch.amp.autocast_mode.autocast.__init__ = _autocast_init  # type: ignore[method-assign]
        threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]
        state.saved_distributed = _as_cuda_distributed.install()
        _forget_streams()
        state.mode.__enter__()
        _installed = state


def uninstall() -> None:
    """Removes what :func:`install` installed (the calling thread must be the installing one)."""
    global _installed
    with _install_lock:
        state = _installed
        if state is None:
            return
        _installed = None
        state.mode.__exit__(None, None, None)
        with _made_lock:
            _made.clear()  # (what was warned stays readable: stream_aliases())
        threading.Thread._bootstrap_inner = _BOOTSTRAP_INNER  # type: ignore[attr-defined]
        _as_cuda_distributed.uninstall(state.saved_distributed)
        torch.amp.autocast_mode.autocast.__init__ = _AUTOCAST_INIT  # type: ignore[method-assign]
        for name, value in state.saved.items():
            if value is _MISSING:
                delattr(torch.cuda, name)
            else:
                setattr(torch.cuda, name, value)
        memory = sys.modules.get("torch.cuda.memory")
        for name, value in state.saved_memory.items():
            setattr(memory, name, value)


_MISSING = object()


def is_installed() -> bool:
    return _installed is not None


@contextlib.contextmanager
def as_cuda(devices: int = 2, *, asynchronous: bool = False, strict: bool = False,
            stacks: bool = True) -> Iterator[None]:
    """Runs the code inside as if ``devices`` CUDA devices were there: on sim devices.

    ``device="cuda"``, ``.cuda()``, ``torch.cuda.Stream``/``Event``/``stream``/``synchronize``
    and the other names of :data:`MAPPED` work on sim, ``x.is_cuda`` is True and
    ``x.device.type`` is ``"cuda"`` for a sim tensor, in the calling thread and in threads
    started inside. With ``stacks`` (the default), races name the Python lines of both accesses
    (:func:`torch_pipeline.sim.report`).

        >>> with sim.as_cuda(devices=2):
        ...     x = torch.ones(4, device="cuda")
        ...     s = torch.cuda.Stream()
        ...     with torch.cuda.stream(s):
        ...         y = x * 2                 # no wait_stream: a race, reported
        >>> print(sim.report())
    """
    from . import enable, report_stacks, set_report_stacks

    enable(num_devices=devices, strict=strict, asynchronous=asynchronous)
    had_stacks = report_stacks()
    had_anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    set_report_stacks(stacks or had_stacks)
    if stacks:
        # Autograd keeps the forward stack of each node in anomaly mode: a race of a backward op
        # names the forward lines that made it. No NaN checks (they would change the program).
        torch.autograd.set_detect_anomaly(True, check_nan=had_anomaly[0] and had_anomaly[1])
    install()
    try:
        yield
    finally:
        uninstall()
        torch.autograd.set_detect_anomaly(*had_anomaly)
        set_report_stacks(had_stacks)
