#!/usr/bin/env bash
# Sets up a virtual environment (.venv) with torch (CPU build unless TORCH_VERSION says otherwise),
# builds torch_pipeline into it and runs the main demo: the print(loss) stall, naive vs pipelined.
# Extra arguments go to the demo (e.g. --steps 400 --log-latency-ms 5).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -c "import torch" 2>/dev/null \
  || "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" ninja setuptools wheel
"$VENV/bin/python" -m pip install -q ninja setuptools wheel
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" examples/async_logging.py "$@"
