"""Build torch_pipeline._C against the torch installed in this environment.

    pip install --no-build-isolation .

A CppExtension on a CPU-only torch. When torch has CUDA (``torch.version.cuda``) and a CUDA
toolkit is found, the ``csrc/cuda`` sources are added (exclusive CUDA streams) and the extension
is built as a CUDAExtension; no GPU is needed to build. ``TORCH_PIPELINE_CUDA=0/1`` overrides the
choice. The build prints what it chose.
"""
import glob
import os
import re
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - a build-time message
    sys.exit(
        "torch_pipeline builds against the torch of this environment: install torch first, then "
        "`pip install --no-build-isolation .` (build isolation would fetch a second torch)"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
# TORCH_PIPELINE_WHEEL=1 (scripts/build_wheel.sh): a wheel for this torch, see _version().
WHEEL = os.environ.get("TORCH_PIPELINE_WHEEL") == "1"
TORCH_RELEASE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def _version(with_cuda: bool) -> str:
    """torch_pipeline/_version.py's version; a wheel's adds the torch it is built for as the local
    part (0.1.0+torch2.13cpu, 0.1.0+torch2.11cu130)."""
    with open(os.path.join(ROOT, "torch_pipeline", "_version.py")) as f:
        version = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)
    if not WHEEL:
        return version
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda else "cpu"
    return f"{version}+torch{TORCH_RELEASE[0]}.{TORCH_RELEASE[1]}{cuda}"


def _requirements() -> list:
    """A wheel pins the torch minor release it was built against (its C++ ABI is torch's); a source
    build needs only a torch it can build against."""
    if not WHEEL:
        return ["torch>=2.8"]
    major, minor = TORCH_RELEASE
    return [f"torch>={major}.{minor},<{major}.{minor + 1}"]


def _sources(*patterns: str) -> list:
    out = []
    for pattern in patterns:
        out += sorted(glob.glob(os.path.join("csrc", pattern)))
    return out


def _choose_cuda() -> tuple:
    env = os.environ.get("TORCH_PIPELINE_CUDA")
    torch_cuda = torch.version.cuda
    toolkit = cpp_extension.CUDA_HOME
    if env not in (None, "", "0", "1"):
        sys.exit(f"TORCH_PIPELINE_CUDA must be 0 or 1, got {env!r}")
    if env == "0":
        return False, "disabled by TORCH_PIPELINE_CUDA=0"
    if env == "1":
        if torch_cuda is None:
            sys.exit("TORCH_PIPELINE_CUDA=1 but this torch has no CUDA (torch.version.cuda is None)")
        if toolkit is None:
            sys.exit("TORCH_PIPELINE_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME)")
        return True, f"forced by TORCH_PIPELINE_CUDA=1 (torch CUDA {torch_cuda}, toolkit {toolkit})"
    if torch_cuda is None:
        return False, "this torch has no CUDA"
    if toolkit is None:
        return False, f"torch has CUDA {torch_cuda} but no CUDA toolkit was found (set CUDA_HOME)"
    return True, f"torch CUDA {torch_cuda}, toolkit {toolkit}"


with_cuda, why = _choose_cuda()
sources = _sources("core/*.cpp", "runtime/*.cpp", "runtime/tracking/*.cpp", "sim/*.cpp", "python/*.cpp")
define_macros = []
if with_cuda:
    sources += _sources("cuda/*.cpp")
    define_macros.append(("TORCH_PIPELINE_WITH_CUDA", "1"))
    extension_class = cpp_extension.CUDAExtension
else:
    extension_class = cpp_extension.CppExtension
print(
    f"torch_pipeline: building {'with' if with_cuda else 'without'} CUDA ({why}) "
    f"against torch {torch.__version__}",
    flush=True,
)

# The torch this build is for, read by torch_pipeline/_guard.py before it loads _C (a build for
# one torch imported under another fails with an undefined symbol, or worse, loads).
with open(os.path.join(ROOT, "torch_pipeline", "_build.py"), "w") as f:
    f.write("# Written by setup.py: the torch this build of torch_pipeline._C is for.\n")
    f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
    f.write(f"CUDA_VERSION = {torch.version.cuda if with_cuda else None!r}\n")

extra_cxx = ["-O2", "-Wall", "-Wno-unused-parameter", "-fvisibility=hidden"]
# A wheel ships without debug information (80 MB of the module's 85 with it).
extra_link = ["-Wl,--strip-debug"] if WHEEL else []
ext = extension_class(
    name="torch_pipeline._C",
    sources=sources,
    define_macros=define_macros,
    extra_compile_args={"cxx": extra_cxx} if with_cuda else extra_cxx,
    extra_link_args=extra_link,
)

setup(
    version=_version(with_cuda),
    install_requires=_requirements(),
    packages=find_packages(include=["torch_pipeline", "torch_pipeline.*", "oneflow_pipeline"]),
    package_data={"torch_pipeline": ["py.typed", "*.pyi"]},
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
