"""The overlap helpers, for the stream problems users bring: thread inheritance (``carry``),
asynchronous scalar reads (``item_async``), host-to-device prefetch (``prefetch``) and activation
offload (``offload``). Each is a few lines over pipelines, each on a pipeline of its own (its
lane); automatic synchronization orders them, so none of them synchronizes the host or asks the
user to."""
from __future__ import annotations

import collections
import os
import threading
import weakref
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Generic,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    TypeVar,
    Union,
    overload,
)

import torch
import torch.futures
from torch.utils._pytree import tree_flatten, tree_map

from . import _C
from ._C import Pipeline, PipelineEvent, current_pipeline
from ._tracking import track

__all__ = ["carry", "item_async", "offload", "prefetch"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
DeviceLike = Union[torch.device, str, int]


# ---- the library's own lanes ------------------------------------------------------------------
_lanes_lock = threading.Lock()
_lanes: dict = {}


def _forget_lanes() -> None:  # a forked child cannot use its parent's pipelines
    global _lanes_lock
    _lanes.clear()
    _lanes_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_lanes)


def _lane(name: str) -> Pipeline:
    """The library's pipeline for ``name`` ("read", "copy"), made on first use, on the last worker
    thread (so a task that waits there does not hold up tasks on thread 0)."""
    with _lanes_lock:
        p = _lanes.get(name)
        if p is None:
            p = Pipeline(_C.get_worker_thread(_C.max_worker_threads() - 1))
            _lanes[name] = p
        return p


def _check_pipeline(value: Optional[Pipeline], what: str) -> None:
    if value is not None and not isinstance(value, Pipeline):
        raise TypeError(f"{what} must be a torch_pipeline.Pipeline or None, got "
                        f"{type(value).__name__}")


# ---- carry --------------------------------------------------------------------------------------
@overload
def carry(fn: F, *, pipeline: Optional[Pipeline] = None) -> F: ...
@overload
def carry(fn: None = None, *, pipeline: Optional[Pipeline] = None) -> Callable[[F], F]: ...


def carry(fn: Optional[F] = None, *, pipeline: Optional[Pipeline] = None) -> Any:
    """``fn`` wrapped to run under the pipeline that is current *now* (or ``pipeline``), on
    whatever thread calls it later.

    PyTorch's current stream is thread-local: a ``threading.Thread`` or a
    ``concurrent.futures`` worker started inside ``with torch.cuda.stream(s):`` runs on the
    default stream, and so does one started inside ``with tp.pipeline(p):``. Wrap its target
    with ``carry`` and it runs under ``p``, with automatic synchronization as on the thread that
    started it.

        >>> with tp.pipeline(p):
        ...     t = threading.Thread(target=tp.carry(work))  # work() runs under p
        ...     pool.submit(tp.carry(step), batch)           # so does step(batch)
    """
    _check_pipeline(pipeline, "carry(pipeline=...)")
    target = pipeline if pipeline is not None else current_pipeline()

    def wrap(f: F) -> F:
        if not callable(f):
            raise TypeError(f"carry needs a callable, got {type(f).__name__}")
        return _C.pipeline(target)(f)

    return wrap if fn is None else wrap(fn)


# ---- item_async ---------------------------------------------------------------------------------
def _read_items(value: Any) -> Any:
    return tree_map(lambda x: x.item() if isinstance(x, torch.Tensor) else x, value)


def item_async(value: Any, *, pipeline: Optional[Pipeline] = None) -> "torch.futures.Future[Any]":
    """The Python value of a one-element tensor (or of each one in a list, tuple or dict), as a
    ``torch.futures.Future``, read without stalling the calling thread.

    ``loss.item()`` waits for the device to finish all work queued so far, which empties the
    device's queue every step. ``item_async(loss)`` reads it on a lane of its own (``pipeline``,
    default a library pipeline on the last worker thread), after the work that produces it and
    nothing else; the caller goes on queueing work.

        >>> fut = tp.item_async({"loss": loss, "acc": acc})
        >>> fut.then(lambda f: print(f.value()))        # or fut.wait() when you need it
    """
    _check_pipeline(pipeline, "item_async(pipeline=...)")
    leaves, _ = tree_flatten(value)
    on_device = False
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                raise ValueError(f"item_async reads one-element tensors, got one of shape "
                                 f"{tuple(x.shape)}")
            on_device |= x.device.type not in ("cpu", "meta")
    if not on_device:  # nothing to wait for: read now
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(_read_items(value))
        return done
    return (pipeline or _lane("read")).submit(_read_items, value)


# ---- prefetch -----------------------------------------------------------------------------------
def _device_of(device: DeviceLike) -> torch.device:
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, str or int, got {type(device).__name__}")
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise ValueError(f"device {device} names an accelerator index, but there is none")
        return torch.device(accelerator.type, device)
    d = torch.device(device)
    if d.type != "cpu" and d.index is None:
        d = torch.device(d.type, torch.accelerator.current_device_index())
    return d


class prefetch(Generic[T]):
    """An iterable of (nested) tensor batches, copied to ``device`` ``depth`` batches ahead of
    the consumer, on a copy lane (``pipeline``, default a library pipeline), with
    ``non_blocking`` copies from pinned memory (batches that are not pinned are pinned first).
    The batches it yields can be used at once: automatic synchronization orders their first use
    after their copy. Hand-written versions of this (Apex's ``data_prefetcher``) call
    ``wait_stream`` and ``record_stream``; this does not need to.

    Works with any iterable (a ``DataLoader``, with or without ``pin_memory``); ``len()`` is the
    wrapped iterable's; exceptions of the iterable reach the consumer; leaving the loop early
    (``break``) finishes the copies in flight and leaves no work behind.

        >>> for x, y in tp.prefetch(loader, "cuda", depth=2):
        ...     loss = loss_fn(model(x), y)
    """

    def __init__(self, iterable: Iterable[T], device: DeviceLike, depth: int = 2,
                 pipeline: Optional[Pipeline] = None) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        _check_pipeline(pipeline, "prefetch(pipeline=...)")
        self.iterable = iterable
        self.device = _device_of(device)
        self.depth = depth
        self.pipeline = pipeline

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        return self._batches()

    def _copy(self, batch: Any, lane: Pipeline) -> Tuple[Any, Any, PipelineEvent]:
        def pin(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.is_pinned():
                return x.pin_memory()
            return x

        host = tree_map(pin, batch)
        with _C.pipeline(lane):
            on_device = tree_map(
                lambda x: x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor)
                else x, host)
            done = lane.record_event()
        return on_device, host, done

    def _batches(self) -> Iterator[T]:
        if self.device.type == "cpu":  # nothing to copy
            yield from self.iterable
            return
        lane = self.pipeline or _lane("copy")
        lane.stream(self.device)  # (acquired up front: the lane's stream there from the start)
        source = iter(self.iterable)
        ahead: Deque[Any] = collections.deque()
        # Host batches stay referenced until their copy is done (their pinned memory is read by
        # it); only those of batches already handed out are queried.
        copying: Deque[Tuple[PipelineEvent, Any]] = collections.deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(ahead) < self.depth:
                    try:
                        batch = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    on_device, host, done = self._copy(batch, lane)
                    ahead.append(on_device)
                    copying.append((done, host))
                if not ahead:
                    return
                while len(copying) > len(ahead) and copying[0][0].query():
                    copying.popleft()
                yield ahead.popleft()
        finally:
            ahead.clear()
            for done, _ in copying:  # early exit or an error: no copy is left running
                done.synchronize()
            copying.clear()


# ---- offload ------------------------------------------------------------------------------------
# Bytes of alignment an offloaded tensor gets back (a fresh allocation is aligned at least this
# much on CUDA and sim): kernels pick vectorized paths, and so accumulation orders, by alignment.
_ALIGN = 256


def _span(t: torch.Tensor) -> int:
    """Elements of storage from ``t``'s first element to its last (0 when it has none): its
    ``numel()`` for a dense layout, fewer for an expanded one, more for a view with gaps."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()))


class _Offloaded:
    __slots__ = ("device", "host", "original", "on_device", "index", "used", "size", "stride",
                 "pad", "__weakref__")

    def __init__(self, device: torch.device, host: Optional[torch.Tensor],
                 original: "_C._SavedOriginal", index: int, t: torch.Tensor) -> None:
        self.device = device
        self.host = host  # None: a parameter (or a view of one), never copied
        # The saved tensor's layout over ``host`` (its storage span, Note [offload layout]), and
        # the elements before it in the copy back that restore its alignment.
        self.size = t.size()
        self.stride = t.stride()
        self.pad = (t.data_ptr() % _ALIGN) // t.element_size()
        self.original = original  # the device tensor while its memory is alive and unchanged
        self.on_device: Optional[torch.Tensor] = None
        self.index = index
        self.used = False  # unpacked by backward at least once


class offload:
    """Saved activations of at least ``min_bytes`` go to pinned host memory during forward and
    come back ahead of need during backward, copied on a copy lane (``pipeline``, default a
    library pipeline) with no host synchronization in either direction.

    ``torch.autograd.graph.save_on_cpu`` copies synchronously: every saved tensor stalls the host
    until the device reaches it. Here the copy out is queued after the op that made the tensor,
    the device memory goes back to the allocator once the copy has read it (automatic
    synchronization keeps it alive until then), and when backward unpacks one tensor the copies
    back of the next ``prefetch`` ones (in reverse order of saving) start too. A saved tensor
    whose memory is still alive and unchanged when backward needs it (an input the caller holds,
    a parameter or a view of one) is used in place, not copied back as a duplicate; parameters
    are not copied out at all.

        >>> with tp.offload(min_bytes=1 << 20):
        ...     loss = model(x).sum()
        >>> loss.backward()

    The device memory of an offloaded tensor returns to the allocator once its copy out has run.
    A host that runs far ahead of the device (nothing in the step waits for it) therefore keeps
    many of them allocated at once; ``max_in_flight`` (bytes) bounds the copies out not yet run,
    the host waiting for the oldest when more are pending (None: never wait).

    ``offloaded`` and ``restored`` count the tensors moved out and back, ``reused`` the ones
    backward found still alive on the device.
    """

    def __init__(self, min_bytes: int = 1 << 20, pipeline: Optional[Pipeline] = None,
                 prefetch: int = 1, max_in_flight: Optional[int] = None) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        if max_in_flight is not None and (isinstance(max_in_flight, bool)
                                          or not isinstance(max_in_flight, int)
                                          or max_in_flight < 0):
            raise ValueError(f"max_in_flight must be None or an int >= 0, got {max_in_flight!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        _check_pipeline(pipeline, "offload(pipeline=...)")
        self.min_bytes = min_bytes
        self.pipeline = pipeline
        self.prefetch = prefetch
        self.max_in_flight = max_in_flight
        self._in_flight: Deque[Tuple[PipelineEvent, int]] = collections.deque()
        self._in_flight_bytes = 0
        self.offloaded = 0
        self.restored = 0
        self.reused = 0
        self._saved: Dict[int, "weakref.ref[_Offloaded]"] = {}  # by order of saving
        self._copied: List[_Offloaded] = []  # copied out in this `with`, declared at its exit
        self._count = 0
        self._lock = threading.Lock()
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _lane(self) -> Pipeline:
        return self.pipeline or _lane("copy")

    def _pack(self, t: torch.Tensor) -> Any:
        if (t.device.type in ("cpu", "meta") or t.layout != torch.strided
                or t.numel() * t.element_size() < self.min_bytes):
            return t
        if t.is_conj() or t.is_neg():
            return t  # a lazy conjugate/negative view: a copy would resolve it, another layout
        original = _C._SavedOriginal(t)
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            # Alive for the whole step anyway: copying it out would free nothing.
            with self._lock:
                return self._add(_Offloaded(t.device, None, original, self._count, t))
        # Autograd packs inside the op that saves the tensor, where the tracker does not look
        # (it observes the outermost op only): the op's streams are ordered here by hand. The op
        # was launched on the current stream after its inputs' producers, so the copy lane waits
        # for the current stream, and the tensor's memory is not reused before the copy has read
        # it (record_stream).
        lane_stream = self._lane().stream(t.device)
        assert lane_stream is not None
        lane_stream.wait_stream(torch.accelerator.current_stream(t.device))
        # Note [offload layout]: backward must get the saved tensor's exact layout back (a conv
        # on channels-last activations, a matmul on a permuted one take other kernels, with other
        # rounding, on a contiguous copy), so the storage span the tensor covers is copied as it
        # is and re-viewed with the tensor's sizes and strides.
        span = _span(t)
        with lane_stream:
            host = torch.empty(span, dtype=t.dtype, pin_memory=True)
            host.copy_(t.detach().as_strided((span,), (1,)), non_blocking=True)
        t.record_stream(lane_stream)
        if self.max_in_flight is not None:
            self._bound(self._lane(), span * t.element_size())
        with self._lock:
            self.offloaded += 1
            saved = self._add(_Offloaded(t.device, host, original, self._count, t))
            self._copied.append(saved)
            return saved

    def _add(self, saved: _Offloaded) -> _Offloaded:  # (under the lock)
        index = saved.index
        self._count += 1
        # (an entry goes when its graph frees it)
        def forget(_: "weakref.ReferenceType[_Offloaded]", i: int = index) -> None:
            self._saved.pop(i, None)

        self._saved[index] = weakref.ref(saved, forget)
        return saved

    def _bound(self, lane: Pipeline, nbytes: int) -> None:
        """At most ``max_in_flight`` bytes of copies out not yet run: the host waits for the
        oldest (the only host synchronization of offload, and only when asked for)."""
        done = lane.record_event()
        self._in_flight.append((done, nbytes))
        self._in_flight_bytes += nbytes
        assert self.max_in_flight is not None
        while self._in_flight and (self._in_flight_bytes > self.max_in_flight
                                   or self._in_flight[0][0].query()):
            event, size = self._in_flight.popleft()
            event.synchronize()
            self._in_flight_bytes -= size

    def _start(self, saved: _Offloaded, lane: Pipeline) -> None:
        # (backward unpacks outside any op: these copies are tracked, and the op that uses the
        # result waits for its copy)
        if saved.on_device is None and saved.host is not None:
            # Allocated on the stream that will use it (backward's), where the memory of the
            # tensors offloaded in forward goes back; written by the copy lane.
            span = saved.host.numel()
            flat = torch.empty(saved.pad + span, dtype=saved.host.dtype, device=saved.device)
            with _C.pipeline(lane):
                flat.narrow(0, saved.pad, span).copy_(saved.host, non_blocking=True)
            saved.on_device = flat.as_strided(saved.size, saved.stride, saved.pad)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Offloaded):
            return saved
        if saved.original.modified():
            # As autograd without offload: the copy out may even have read the new values.
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: a tensor saved for backward under tp.offload was written in "
                "place between forward and backward; clone it before writing, or write after "
                "backward")
        if saved.on_device is None:
            original = saved.original.get()
            if original is not None:  # still alive and unchanged: no copy back
                with self._lock:
                    saved.used = True
                    self.reused += 1
                return original
            if saved.host is None:
                raise RuntimeError(
                    "a parameter saved for backward under tp.offload was freed before backward; "
                    "keep the module alive until backward has run")
        lane = self._lane()
        self._start(saved, lane)
        with self._lock:
            ahead = []
            for i in range(saved.index - 1, max(-1, saved.index - 1 - 4 * self.prefetch), -1):
                ref = self._saved.get(i)
                other = ref() if ref is not None else None
                if (other is not None and not other.used and other.on_device is None
                        and other.host is not None and other.original.get() is None):
                    ahead.append(other)
                    if len(ahead) == self.prefetch:
                        break
            saved.used = True
            self.restored += 1
        for other in ahead:  # the next ones backward is likely to need
            self._start(other, lane)
        on_device, saved.on_device = saved.on_device, None  # (the graph's use is its only one)
        assert on_device is not None
        return on_device

    def __enter__(self) -> "offload":
        if self._hooks is not None:
            raise RuntimeError("this tp.offload is already entered; make one per `with`")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        assert hooks is not None
        hooks.__exit__(*exc)
        with self._lock:
            copied, self._copied = self._copied, []
        # The copies out read their tensors on the lane where the tracker did not look (inside
        # the ops that saved them). Saved tensors still alive now (an input the caller holds, an
        # output it keeps) may be written later, e.g. after backward used them in place: declare
        # the lane's reads (the lane runs in order, so after the copies) so that those writes
        # wait for them. (A dead one's memory is kept from reuse by record_stream.)
        alive = [t for t in (saved.original.get() for saved in copied) if t is not None]
        if alive:
            with _C.pipeline(self._lane()), track(read=alive):
                pass
