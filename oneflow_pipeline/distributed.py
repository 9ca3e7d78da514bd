"""Alias of :mod:`torch_pipeline.distributed`.

    >>> import oneflow_pipeline.distributed as ofd
    >>> groups = ofd.thread_groups()
"""
from torch_pipeline.distributed import *  # noqa: F401,F403
from torch_pipeline.distributed import __all__  # noqa: F401
