#!/usr/bin/env bash
# Lint and type-check the Python package (configuration in pyproject.toml): ruff (pycodestyle,
# pyflakes, import order) and mypy over torch_pipeline/ and its stub _C.pyi; and the C++ format
# (.clang-format) of csrc/ and tests/cpp/, and the length of csrc/'s files. Fails on any finding.
#   bash scripts/lint.sh [VENV]    (default .venv; the tools are installed into it with pip)
# To apply the C++ format: git ls-files 'csrc/*.[ch]*' 'tests/cpp/*.[ch]*' | xargs clang-format -i
# The venv needs torch (mypy reads its types); torch_pipeline need not be built.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
"$VENV/bin/python" -m pip install -q "ruff==0.17.6" "mypy==2.4.1" "clang-format==20.1.8"
"$VENV/bin/python" -m ruff check torch_pipeline
"$VENV/bin/python" -m mypy
git ls-files -z 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.cpp' 'tests/cpp/*.h' \
  | xargs -0 "$VENV/bin/clang-format" --dry-run --Werror
# docs/design.md, "Layout": no file under csrc/ over 500 lines.
long=$(git ls-files -z 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' | xargs -0 wc -l | awk '$2 != "total" && $1 > 500')
if [ -n "$long" ]; then
  echo "lint: files under csrc/ over 500 lines (split them):"
  echo "$long"
  exit 1
fi
echo "lint: ruff, mypy and clang-format clean; no csrc/ file over 500 lines"
