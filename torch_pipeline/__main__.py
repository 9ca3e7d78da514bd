"""``python -m torch_pipeline``: what this installation is and sees, for bug reports.

Prints, one ``name: value`` per line: the versions (torch_pipeline, torch, Python, platform), how
the extension was built (with or without CUDA, the compiler, the torch it was compiled against),
the devices it sees, the worker-thread cap, the tracking and keep-alive modes, and the
environment variables in effect. It creates no pipeline and starts no worker thread. A setting
that cannot be read (a bad environment variable) is printed as its error, and the exit status is
then 1.

    $ python -m torch_pipeline
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Callable, List, Tuple

import torch

import torch_pipeline as tp
from torch_pipeline import _C

# Environment variables torch_pipeline reads (at run time, except TORCH_PIPELINE_CUDA: build time).
KNOWN_VARIABLES = (
    "TORCH_PIPELINE_MAX_WORKER_THREADS",
    "TORCH_PIPELINE_EXIT_TIMEOUT",
    "TORCH_PIPELINE_ALLOCATOR_SAFETY",
    "TORCH_PIPELINE_DEBUG_COLLECTIVES",
    "TORCH_PIPELINE_CUDA",
)
# Variables of other software that change what torch_pipeline sees.
OTHER_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "PYTORCH_CUDA_ALLOC_CONF")


def _devices() -> List[Tuple[str, str]]:
    rows: List[Tuple[str, str]] = []
    current = _C._current_accelerator_device()
    rows.append(("accelerator", "none (CPU only)" if current is None else current.type))
    cuda = torch.cuda.is_available()
    rows.append(("cuda available", str(cuda)))
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                      f"capability {props.major}.{props.minor}"))
    rows.append(("exclusive CUDA streams", str(bool(_C._cuda_exclusive_streams()))))
    rows.append(("sim device", "enabled" if _C._sim_enabled() else
                 "not enabled (a program turns it on with torch_pipeline.sim.enable())"))
    return rows


def _setting(read: Callable[[], object]) -> Tuple[str, bool]:
    try:
        return str(read()), True
    except Exception as e:  # a bad environment variable: print what it says
        return f"error: {type(e).__name__}: {e}", False


def report() -> Tuple[List[Tuple[str, str]], bool]:
    """The rows that ``python -m torch_pipeline`` prints, and whether every setting was read."""
    build = _C._build_info()
    rows: List[Tuple[str, str]] = [
        ("torch_pipeline", f"{tp.__version__} ({os.path.dirname(tp.__file__)})"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("built with CUDA", str(build["cuda"])),
        ("built against torch", str(build["torch"])),
        ("compiler", f"{build['compiler']}, C++ {build['cplusplus']}"
                     + (f", CXX11 ABI {int(build['cxx11_abi'])}" if "cxx11_abi" in build else "")),
    ]
    built = str(build["torch"])
    if not torch.__version__.startswith(built):
        rows.append(("warning", f"built against torch {built} but running torch "
                                f"{torch.__version__}: rebuild "
                                f"(pip install --no-build-isolation .)"))
    rows += _devices()
    ok = True
    for name, read in (
        ("max worker threads", _C.max_worker_threads),
        ("allocator safety (keep-alive mode)", _C._allocator_safety),
        ("exit timeout (s)", lambda: _C._env_seconds("TORCH_PIPELINE_EXIT_TIMEOUT") or "none"),
        ("debug collectives", _C._collective_debug),
    ):
        value, read_ok = _setting(read)
        ok = ok and read_ok
        rows.append((name, value))
    rows.append(("tracking", f"{'enabled' if _C._tracking_enabled() else 'disabled'}, "
                             f"{'live' if tp.tracking_stats()['live'] else 'idle'} "
                             "(live while a non-default pipeline exists)"))
    for name in KNOWN_VARIABLES + OTHER_VARIABLES:
        rows.append((f"${name}", os.environ.get(name, "(unset)")))
    for name in sorted(os.environ):
        if name.startswith("TORCH_PIPELINE_") and name not in KNOWN_VARIABLES:
            rows.append((f"${name}", f"{os.environ[name]} (not a torch_pipeline setting)"))
    return rows, ok


def main() -> int:
    rows, ok = report()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name + ':':<{width + 1}} {value}")
    print("(include this output in bug reports)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
