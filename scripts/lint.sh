#!/usr/bin/env bash
# Lint and type-check the Python package (configuration in pyproject.toml): ruff (pycodestyle,
# pyflakes, import order) and mypy over torch_pipeline/ and its stub _C.pyi. Fails on any finding.
#   bash scripts/lint.sh [VENV]    (default .venv; ruff and mypy are installed into it with pip)
# The venv needs torch (mypy reads its types); torch_pipeline need not be built.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
"$VENV/bin/python" -m pip install -q "ruff==0.17.6" "mypy==2.4.1"
"$VENV/bin/python" -m ruff check torch_pipeline
"$VENV/bin/python" -m mypy
echo "lint: ruff and mypy clean"
