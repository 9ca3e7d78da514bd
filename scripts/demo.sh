#!/usr/bin/env bash
# Sets up a virtual environment (.venv) with torch==TORCH_VERSION (default 2.13.0), builds
# torch_pipeline into it and runs the main demo: the print(loss) stall, naive vs pipelined.
# Extra arguments go to the demo (e.g. --steps 400 --log-latency-ms 5).
# torch comes from pip's configured indexes, or from TORCH_INDEX_URL when set: on Linux, PyPI's
# torch is the CUDA build (several GB, works on the CPU too); for the CPU build use
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_INDEX=()
[ -z "${TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$TORCH_INDEX_URL")
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -c "import torch" 2>/dev/null \
  || "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"}
# numpy: without it, importing torch prints "Failed to initialize NumPy"
"$VENV/bin/python" -m pip install -q numpy ninja setuptools wheel
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" examples/async_logging.py "$@"
