"""``UntypedStorage.resize_`` under automatic synchronization.

FSDP frees a parameter's memory with ``tensor.untyped_storage().resize_(0)`` and allocates it again
with ``resize_(nbytes)``. That is no dispatcher op (the storage's allocator is called directly), so
the tracker would not see it: memory freed while another pipeline still reads it would go back to
the allocator at once, and memory allocated on a pipeline's stream would keep the home stream of
the storage's first block. The wrap (installed with the first Pipeline, like the CUDA graph hooks;
importing torch_pipeline changes nothing in torch) runs the resize of a device storage inside a
``_C._StorageResize`` scope: it is ordered like an op writing the storage (its old block is not
reused before the uses it waits for), and memory it allocates is homed on the current stream.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from . import _C
from ._once import once

_HOOKED = "_torch_pipeline_hooked"


@once
def install_storage_hooks() -> None:
    """Wraps ``torch.UntypedStorage.resize_`` (once)."""
    cls = torch.UntypedStorage
    original = getattr(cls, "resize_", None)
    if original is None or getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def resize_(self: Any, size: Any) -> Any:
        if self.device.type == "cpu" or not _C._tracking_live():
            return original(self, size)
        scope = _C._StorageResize(self)
        try:
            return original(self, size)
        finally:
            scope.done()

    setattr(resize_, _HOOKED, True)
    cls.resize_ = resize_  # type: ignore[method-assign]
