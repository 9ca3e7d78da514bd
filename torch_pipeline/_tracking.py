"""tp.track: accesses that automatic synchronization cannot see (raw kernel launches)."""
from __future__ import annotations

from types import TracebackType
from typing import Any, Dict, Iterable, List, Optional, Type, Union

import torch

from . import _C

__all__ = ["track", "tracking_stats"]


def tracking_stats() -> Dict[str, Any]:
    """Counters of automatic synchronization, for monitoring and bug reports.

    Keys (counts since the process started unless marked *now*):

    * ``live`` -- tracking is on now (a non-default pipeline, or a task pinning tensors, is alive)
    * ``ops`` -- ops observed; ``launches`` -- their launches on streams (one per device stream)
    * ``waits`` -- event waits inserted on streams; ``events`` -- events recorded for them
    * ``host_waits`` -- CPU ops that first waited for a ``non_blocking`` copy
    * ``pin_waits`` -- writes that waited for a task pinning their tensor
    * ``keep_alives`` / ``released`` -- storages kept alive for a use off their allocation stream,
      and those let go since; ``kept_alive`` / ``kept_alive_bytes`` -- kept alive *now*
    * ``record_streams`` -- storages handed to the caching allocator's ``record_stream`` instead
    * ``storages`` / ``streams`` -- storages and streams with tracked state *now* (bounded by the
      live storages and streams, whatever the number of ops)
    * ``unclaimed`` -- ops on tensors without storage (``torch.func`` transforms, wrapper
      subclasses such as DTensor) left to the ops they call, which are tracked instead
    * ``gaps`` / ``gap_ops`` -- ops on a device whose memory accesses could not be accounted for,
      and their names (each also warned about once: declare such accesses with :class:`track`)
    * ``compiled_regions`` -- calls of ``torch.compile``'d code (AOTAutograd's forward, backward
      and inference) tracked as one op each; ``compiled_unwrapped`` -- compiled regions in which
      nothing could be tracked (warned about once)
    * ``captures`` -- graph captures seen (``torch.cuda.graph``, CUDA graph trees, the sim twin);
      ``captures_underway`` -- of those, underway *now* (the tracker queries no device meanwhile);
      ``polls_paused`` -- keep-alive polls and host waits skipped because a capture was underway
    * ``capture_forks`` / ``capture_joins`` -- side pipelines' streams forked into a capture at
      their first op there, and joined back at its end because nothing had waited for them
    * ``capture_kept`` -- storages kept alive for the lifetime of a captured graph;
      ``graph_replays`` -- replays ordered like one op on the replaying stream
    * ``observer`` -- how ops are observed: ``"dispatcher"`` (the default: a dispatcher fallback
      on a thread-local key, paid once per observed op) or ``"record_function"`` (a global
      RecordFunction callback; ``TORCH_PIPELINE_OBSERVER`` chooses); ``unobserved`` -- device
      ops of threads the dispatcher path did not observe (a thread started in C++), noticed,
      warned about once, and observed from then on

    Example::

        >>> s = tp.tracking_stats()
        >>> print(s["waits"], s["kept_alive_bytes"], s["gap_ops"])
    """
    return dict(_C._tracking_stats())

TensorsLike = Union[torch.Tensor, Iterable[torch.Tensor]]


def _tensor_list(value: TensorsLike, what: str) -> List[torch.Tensor]:
    items = [value] if isinstance(value, torch.Tensor) else value
    try:
        tensors = list(items)
    except TypeError:
        raise TypeError(f"track({what}=...) expects a tensor or an iterable of tensors, got "
                        f"{type(value).__name__}") from None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"track({what}=...) expects tensors, got an element of type "
                            f"{type(t).__name__}")
    return tensors


class track:
    """Declares accesses the dispatcher never sees (kernels launched on raw data pointers, say by
    a custom extension or Triton launcher that bypasses torch ops), so that automatic
    synchronization covers them.

    On entry the current streams of the tensors' devices wait as they would before an op that reads
    ``read`` and writes ``write``; on exit the end of those accesses is recorded, so later ops on
    other pipelines wait for it. Launch the raw kernels on the current stream inside the block.
    Does nothing while no non-default pipeline is alive (nothing is tracked then).

        >>> with tp.pipeline(p), tp.track(read=[x], write=[out]):
        ...     my_ext.launch(x.data_ptr(), out.data_ptr(), torch.cuda.current_stream().cuda_stream)
    """

    def __init__(self, read: TensorsLike = (), write: TensorsLike = ()) -> None:
        self._reads = _tensor_list(read, "read")
        self._writes = _tensor_list(write, "write")
        self._scope: Optional[_C._TrackScope] = None

    def __enter__(self) -> "track":
        if self._scope is not None:
            raise RuntimeError("this track(...) block is already entered; make a new one")
        self._scope = _C._TrackScope(self._reads, self._writes)
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._scope = None  # records the end of the accesses
