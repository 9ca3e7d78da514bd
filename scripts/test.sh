#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine and runs them:
#   1. the plain-C++ core under GoogleTest: plain, ASan+UBSan, TSan (tests/cpp/run_all.sh);
#   2. a virtual environment (.venv) with torch and the test tools;
#   3. torch_pipeline built into it (pip install --no-build-isolation -e .);
#   4. pytest over tests/python (GPU-marked tests are skipped without a GPU).
# Fails on the first failure. TORCH_VERSION (default 2.13.0) and VENV can be overridden; torch
# comes from pip's configured indexes, or from TORCH_INDEX_URL when set (on Linux, PyPI's torch is
# the CUDA build: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives the CPU build).
# Step 1 needs cmake, g++ and libgtest-dev: missing ones are installed with apt-get (through
# sudo when not root). The whole run takes 20-25 minutes on 2 cores, 10-12 of them step 4.
# PYTHON_ONLY=1 skips step 1 (no apt, no GoogleTest): set up, build, pytest. Extra arguments go to
# pytest (e.g. PYTHON_ONLY=1 bash scripts/test.sh -x -k tracking).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
PYTHON_ONLY="${PYTHON_ONLY:-0}"
TORCH_INDEX=()
[ -z "${TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$TORCH_INDEX_URL")

if [ "$PYTHON_ONLY" != 1 ]; then
  need_apt=()
  command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
  command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
  [ -f /usr/lib/x86_64-linux-gnu/libgtest.a ] || [ -f /usr/lib/aarch64-linux-gnu/libgtest.a ] \
    || [ -f /usr/lib/libgtest.a ] || need_apt+=(libgtest-dev)
  if [ ${#need_apt[@]} -gt 0 ]; then
    echo "== installing ${need_apt[*]} (apt)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi

  echo "== C++ core: GoogleTest (plain, ASan+UBSan, TSan)"
  bash tests/cpp/run_all.sh
fi

echo "== Python environment: $VENV with torch==$TORCH_VERSION"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"}
"$VENV/bin/python" -m pip install -q pytest pytest-timeout hypothesis numpy expecttest torchgpipe==0.0.7 \
  ninja setuptools wheel
echo "== building torch_pipeline"
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import torch, torch_pipeline; print('torch', torch.__version__, '| torch_pipeline', torch_pipeline.__version__)"

echo "== pytest"
"$VENV/bin/python" -m pytest tests/python -p no:cacheprovider -ra "$@"
