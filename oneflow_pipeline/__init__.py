"""Alias of :mod:`torch_pipeline`, under the name the design was first described with.

    >>> import oneflow_pipeline as ofp
    >>> p = ofp.Pipeline()
"""
from torch_pipeline import *  # noqa: F401,F403
from torch_pipeline import __all__, __version__  # noqa: F401


def __getattr__(name: str) -> object:
    # oneflow_pipeline.distributed, imported on first use like torch_pipeline.distributed.
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
