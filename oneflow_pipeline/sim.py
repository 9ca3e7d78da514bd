"""Alias of :mod:`torch_pipeline.sim`.

    >>> import oneflow_pipeline.sim as sim
    >>> sim.enable(num_devices=2)
"""
from torch_pipeline.sim import *  # noqa: F401,F403
from torch_pipeline.sim import __all__  # noqa: F401
