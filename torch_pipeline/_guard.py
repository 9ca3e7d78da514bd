"""Loading the compiled module ``torch_pipeline._C``, with errors that say what to do.

``_C`` links against torch's C++ libraries, whose ABI changes between torch releases: a build for
one torch imported under another fails with an undefined symbol, or worse, loads. The build writes
``_build.py`` beside this file (setup.py) with the torch it was compiled against; the import checks
it before loading ``_C``::

    >>> from torch_pipeline._guard import load_extension
    >>> _C = load_extension()   # ImportError naming both versions on a mismatch
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional, Tuple

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD_HINT = ("build it against this torch with `pip install --no-build-isolation .` (from a "
               "checkout: `pip install --no-build-isolation -e .`), or install the wheel built "
               "for this torch")


def _release(version: str) -> Tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu' or '2.14.0.dev20260101'."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _compiled_module_present() -> bool:
    return any(name.startswith("_C.") and name.endswith((".so", ".pyd"))
               for name in os.listdir(_HERE))


def mismatch(built_torch: str, built_cuda: Optional[str], torch_version: str,
             torch_cuda: Optional[str]) -> Optional[str]:
    """Why an extension built against (built_torch, built_cuda) cannot load under
    (torch_version, torch_cuda), or None when it can: the same torch minor release, and a CUDA
    torch for a CUDA build."""
    if _release(built_torch) != _release(torch_version):
        return (f"torch_pipeline was built against torch {built_torch}, but this environment has "
                f"torch {torch_version}: the extension's C++ ABI is torch's, and differs between "
                f"torch releases")
    if built_cuda is not None and torch_cuda is None:
        return (f"torch_pipeline was built with CUDA {built_cuda} against torch {built_torch}, but "
                f"this torch ({torch_version}) is a CPU-only build")
    return None


def load_extension() -> ModuleType:
    """Imports and returns ``torch_pipeline._C``, or raises ImportError saying what to do."""
    # NB: both files must be in this directory, not merely importable: an editable install's
    # finder (setuptools' __editable__ hook) resolves ``torch_pipeline._build`` and ``_C`` in the
    # checkout it was installed from when a copy of the package without a build is imported.
    if not _compiled_module_present():
        raise ImportError(
            f"torch_pipeline's compiled module (_C) is not built in {_HERE}: this is a source "
            f"tree without a build; {_BUILD_HINT}.")
    build = None
    if os.path.exists(os.path.join(_HERE, "_build.py")):
        build = importlib.import_module("torch_pipeline._build")
    if build is not None:
        why = mismatch(build.TORCH_VERSION, build.CUDA_VERSION, torch.__version__,
                       torch.version.cuda)
        if why is not None:
            raise ImportError(f"{why}. Install a torch_pipeline built for torch "
                              f"{torch.__version__}, or {_BUILD_HINT}.")
    try:
        return importlib.import_module("torch_pipeline._C")
    except ImportError as e:
        built = f" (built against torch {build.TORCH_VERSION})" if build is not None else ""
        raise ImportError(
            f"torch_pipeline's compiled module could not be loaded{built} under torch "
            f"{torch.__version__}: {e}. If torch changed since the build, {_BUILD_HINT}.") from e
