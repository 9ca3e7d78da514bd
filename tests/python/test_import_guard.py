"""Importing torch_pipeline says what to do when its compiled module is missing or was built for
another torch (torch_pipeline/_guard.py), instead of "cannot import name '_C' from partially
initialized module" or an undefined symbol; ``python -m torch_pipeline`` from such a tree too."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_pipeline

PACKAGE = Path(torch_pipeline.__file__).parent


def _copy_package(tmp_path: Path, with_compiled: bool) -> Path:
    """A copy of the installed package under tmp_path (with or without its compiled module)."""
    dest = tmp_path / "torch_pipeline"
    ignore = shutil.ignore_patterns("__pycache__", *(() if with_compiled else ("_C.*.so", "_build.py")))
    shutil.copytree(PACKAGE, dest, ignore=ignore)
    return tmp_path


def _run(root: Path, *args: str) -> "subprocess.CompletedProcess[str]":
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_source_tree_without_the_compiled_module_says_how_to_build_it(tmp_path: Path) -> None:
    root = _copy_package(tmp_path, with_compiled=False)
    for args in (["-c", "import torch_pipeline"], ["-m", "torch_pipeline"]):
        proc = _run(root, *args)
        assert proc.returncode != 0
        assert "ImportError" in proc.stderr and "is not built" in proc.stderr, proc.stderr
        assert "pip install --no-build-isolation" in proc.stderr
        assert "partially initialized" not in proc.stderr


def test_a_build_for_another_torch_names_both_versions(tmp_path: Path) -> None:
    root = _copy_package(tmp_path, with_compiled=True)
    (root / "torch_pipeline" / "_build.py").write_text(
        "TORCH_VERSION = '2.0.1+cpu'\nCUDA_VERSION = None\n")
    proc = _run(root, "-c", "import torch_pipeline")
    assert proc.returncode != 0
    assert "built against torch 2.0.1+cpu" in proc.stderr, proc.stderr
    assert f"this environment has torch {torch.__version__}" in proc.stderr
    assert "pip install --no-build-isolation" in proc.stderr


def test_the_build_records_the_torch_it_is_for() -> None:
    from torch_pipeline import _build

    assert _build.TORCH_VERSION == torch.__version__
    assert (_build.CUDA_VERSION is not None) == bool(torch_pipeline._C._cuda_exclusive_streams())


@pytest.mark.parametrize("built, built_cuda, now, now_cuda, ok", [
    ("2.13.0+cpu", None, "2.13.0+cpu", None, True),
    ("2.13.0+cpu", None, "2.13.1", "13.0", True),        # a patch release, a CUDA torch: loads
    ("2.11.0+cu130", "13.0", "2.11.0+cu130", "13.0", True),
    ("2.11.0+cu130", "13.0", "2.11.0+cpu", None, False),  # a CUDA build under a CPU torch
    ("2.13.0+cpu", None, "2.14.1", "13.0", False),
    ("2.14.0.dev20260101", None, "2.13.0", None, False),
])
def test_which_torch_a_build_loads_under(built: str, built_cuda: "str | None", now: str,
                                          now_cuda: "str | None", ok: bool) -> None:
    from torch_pipeline._guard import mismatch

    assert (mismatch(built, built_cuda, now, now_cuda) is None) == ok
