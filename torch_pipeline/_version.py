"""The version of torch_pipeline: the one place it is written (setup.py reads it; a wheel adds the
torch it was built for as the local part, e.g. ``0.1.0+torch2.13cpu``)."""
__version__ = "0.1.0"
