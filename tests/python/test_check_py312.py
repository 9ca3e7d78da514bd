"""scripts/check_py312.py, CI's scan for what Python 3.12 removed (the GPU machine runs 3.12): it
flags each kind of use it knows, and the project's own sources are clean."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_py312", ROOT / "scripts" / "check_py312.py")
check_py312 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_py312)


@pytest.mark.parametrize("source, what", [
    ("import distutils.core\n", "imports distutils.core"),
    ("from imp import reload\n", "imports imp"),
    ("import pkg_resources\n", "imports pkg_resources"),
    ("self.assertEquals(1, 1)\n", "uses .assertEquals"),
    ("import configparser\nconfigparser.SafeConfigParser()\n", "uses .SafeConfigParser"),
    ("import ssl\nssl.wrap_socket(None)\n", "uses .wrap_socket"),
    ("import locale\nlocale.format('%d', 1)\n", "uses locale.format"),
    ("class F:\n    def find_module(self, name): ...\n", "defines find_module"),
    ("x = '\\d'\n", "invalid escape sequence"),
    ("def f(:\n", "does not compile"),
])
def test_each_removed_use_is_flagged(source: str, what: str) -> None:
    found = check_py312.problems_in(Path("m.py"), source)
    assert any(what in line for line in found), found


def test_setuptools_is_allowed_in_setup_py_only() -> None:
    assert check_py312.problems_in(Path("setup.py"), "import setuptools\n") == []
    assert check_py312.problems_in(Path("m.py"), "import setuptools\n")


def test_the_projects_sources_are_clean() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found = []
    for path in check_py312.tracked_python_files(ROOT):
        found += check_py312.problems_in(path, path.read_text(encoding="utf-8"))
    assert found == []
