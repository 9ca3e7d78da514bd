#!/usr/bin/env bash
# Builds the API reference (docs/index.rst, docs/api/*.rst: Sphinx autodoc over the installed
# package's docstrings) with warnings as errors, so that a docstring that does not render fails CI.
#   bash scripts/build_docs.sh [VENV] [OUTDIR]    (defaults: .venv, a temporary directory)
# The venv must have torch_pipeline built (scripts/test.sh makes .venv so); Sphinx is installed
# into it with pip. The guides are Markdown read on GitHub (README.md, docs/*.md), not built here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
OUT="${2:-$(mktemp -d /tmp/torch_pipeline-docs.XXXXXX)}"
"$VENV/bin/python" -m pip install -q "sphinx>=8,<10"
"$VENV/bin/python" -c "import torch_pipeline" # a clear ImportError first, not a Sphinx traceback
"$VENV/bin/python" -m sphinx -E -W --keep-going -q -b html docs "$OUT"
test -s "$OUT/api/torch_pipeline.html"
grep -q 'id="torch_pipeline.Pipeline.submit"' "$OUT/api/torch_pipeline.html"
echo "docs: API reference built in $OUT"
