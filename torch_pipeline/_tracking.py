"""tp.track: accesses that automatic synchronization cannot see (raw kernel launches)."""
from __future__ import annotations

from types import TracebackType
from typing import Iterable, List, Optional, Type, Union

import torch

from . import _C

__all__ = ["track"]

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
