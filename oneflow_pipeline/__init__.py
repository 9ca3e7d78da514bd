"""Alias of :mod:`torch_pipeline`, under the name the design was first described with.

    >>> import oneflow_pipeline as ofp
    >>> p = ofp.Pipeline()
"""
from torch_pipeline import *  # noqa: F401,F403
from torch_pipeline import __all__, __version__  # noqa: F401
