#!/usr/bin/env bash
# Tests a built wheel as a user gets it: a fresh venv with only torch and the test tools, the wheel
# installed with pip (its torch pin must be met by the torch there: pip installs nothing more), no
# compiler on PATH, and the Python tests run from a copy of the tracked files that has no build in
# it, so that nothing can import the source tree's package by mistake.
#   bash scripts/test_wheel.sh [WHEEL] [-- PYTEST_ARGS...]
# WHEEL defaults to the newest dist/torch_pipeline-*+torch*.whl (scripts/build_wheel.sh). "No
# compiler" means gcc, g++, cc, c++, clang, clang++ and nvcc on PATH are stubs that fail, CC, CXX
# and CUDA_HOME are unset, and torch.utils.cpp_extension cannot build anything.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
WHEEL=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then WHEEL="$1"; shift; fi
[ $# -eq 0 ] || { [ "$1" = "--" ] && shift; }
if [ -z "$WHEEL" ]; then
  WHEEL=$(ls -t dist/torch_pipeline-*+torch*.whl 2>/dev/null | head -1 || true)
fi
[ -n "$WHEEL" ] && [ -f "$WHEEL" ] || { echo "no wheel: run scripts/build_wheel.sh first" >&2; exit 1; }
WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
# The torch the wheel was built for, from its local version (0.1.0+torch2.13cpu -> 2.13).
TORCH_MINOR=$(basename "$WHEEL" | sed -n 's/^torch_pipeline-[^+]*+torch\([0-9]*\.[0-9]*\).*/\1/p')
[ -n "$TORCH_MINOR" ] || { echo "cannot read the torch version from $WHEEL" >&2; exit 1; }
TORCH_VERSION="${TORCH_VERSION:-$TORCH_MINOR.0}"
PYTHON="${PYTHON:-python3}"

WORK=$(mktemp -d /tmp/tp-wheel-test.XXXXXX)
trap 'cd / && rm -rf "$WORK"' EXIT  # (the venv is about 1 GB)
VENV="$WORK/venv"
echo "== fresh venv $VENV: torch==$TORCH_VERSION and the test tools, then $(basename "$WHEEL")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q --no-cache-dir "torch==$TORCH_VERSION" pytest pytest-timeout hypothesis torchgpipe==0.0.7 \
  numpy expecttest
before=$("$VENV/bin/python" -m pip freeze | sort)
"$VENV/bin/python" -m pip install -q "$WHEEL"
added=$(comm -13 <(echo "$before") <("$VENV/bin/python" -m pip freeze | sort))
if [ "$(echo "$added" | grep -cv '^torch_pipeline')" != 0 ]; then
  echo "installing the wheel changed more than torch_pipeline:" >&2
  echo "$added" >&2
  exit 1
fi

# No compiler: stubs that fail, first on PATH.
NOCC="$WORK/no-compiler"
mkdir -p "$NOCC"
for cc in gcc g++ cc c++ clang clang++ nvcc x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ \
          aarch64-linux-gnu-gcc aarch64-linux-gnu-g++; do
  printf '#!/bin/sh\necho "%s: no compiler in the wheel test (scripts/test_wheel.sh)" >&2\nexit 127\n' \
    "$cc" > "$NOCC/$cc"
  chmod +x "$NOCC/$cc"
done
export PATH="$NOCC:$VENV/bin:$PATH"
unset CC CXX CUDA_HOME CUDA_PATH VIRTUAL_ENV PYTHONPATH || true
if g++ --version >/dev/null 2>&1; then echo "a compiler is still on PATH" >&2; exit 1; fi

# A copy of the tracked files: the tests and the files they read, no build output.
TREE="$WORK/tree"
mkdir -p "$TREE"
git ls-files -z | xargs -0 cp --parents -t "$TREE"

echo "== smoke test (from $WORK, outside any source tree)"
cd "$WORK"
python - "$VENV" <<'EOF'
import os, sys
import torch
import torch_pipeline as tp
import torch_pipeline.sim as sim

venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(tp.__file__)
assert where.startswith(venv + os.sep), f"torch_pipeline imported from {where}, not the venv"
sim.enable(num_devices=1)
p = tp.Pipeline()
x = torch.arange(8.0, device="sim:0")
with tp.pipeline(p):
    y = x * 2 + 1
assert torch.equal(y.cpu(), torch.arange(8.0) * 2 + 1)
print("wheel smoke test: torch", torch.__version__, "| torch_pipeline", tp.__version__, "from", where)
EOF
python -m torch_pipeline >/dev/null

echo "== pytest over the copy's tests/python, against the installed wheel"
# (from outside the copy: its torch_pipeline/ has no compiled module, so a test that imported it
# instead of the wheel would fail loudly; conftest.py checks where the tests' own import came from)
TORCH_PIPELINE_TEST_INSTALLED="$VENV" python -m pytest "$TREE/tests/python" -p no:cacheprovider \
  -ra "$@"
