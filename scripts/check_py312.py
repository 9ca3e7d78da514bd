"""Checks that the project's Python sources use nothing Python 3.12 removed (the GPU machine runs
3.12; CI may run an older one). A static scan, cheap enough for every CI run:

* imports of modules gone in 3.12 (distutils, imp, asynchat, asyncore, smtpd) or 3.13 (cgi,
  telnetlib, ...), and of pkg_resources/setuptools outside setup.py (a 3.12 venv has no setuptools);
* attributes gone in 3.12: unittest's assert aliases (assertEquals, ...), configparser's
  SafeConfigParser/readfp, ssl.wrap_socket/match_hostname, locale.format, pkgutil.ImpImporter, and
  the import-system methods find_module/find_loader/load_module (3.12 no longer calls them);
* source that does not compile when warnings are errors (invalid escape sequences such as "\\d"
  are a SyntaxWarning from 3.12 on).

    python scripts/check_py312.py [PATH ...]   # default: the tracked *.py files; exit 1 on a hit
"""
from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Iterable, List

REMOVED_MODULES = {
    # 3.12 (PEP 632, PEP 594's first wave)
    "distutils", "imp", "asynchat", "asyncore", "smtpd",
    # 3.13 (PEP 594)
    "aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "msilib", "nis",
    "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib",
    "lib2to3",
}
# Not in a fresh 3.12 venv (venv stopped installing setuptools in 3.12).
NOT_IN_A_312_VENV = {"pkg_resources", "setuptools"}
REMOVED_ATTRIBUTES = {
    # unittest.TestCase aliases removed in 3.12
    "assertEquals", "assertNotEquals", "assertAlmostEquals", "assertNotAlmostEquals",
    "assertRegexpMatches", "assertNotRegexpMatches", "assertRaisesRegexp",
    "assertDictContainsSubset",
    "failUnless", "failIf", "failUnlessEqual", "failIfEqual", "failUnlessRaises",
    "failUnlessAlmostEqual", "failIfAlmostEqual", "assert_",
    # configparser, ssl, locale, pkgutil
    "SafeConfigParser", "readfp", "wrap_socket", "match_hostname", "RAND_pseudo_bytes",
    "ImpImporter", "ImpLoader",
    # the import system no longer calls these (use find_spec/exec_module)
    "find_module", "find_loader", "load_module",
}
# locale.format was removed in 3.12 (format_string stays); only flagged on the locale module.
REMOVED_QUALIFIED = {("locale", "format"), ("typing", "io"), ("typing", "re")}


def problems_in(path: Path, source: str) -> List[str]:
    """What in `source` (the text of `path`) Python 3.12 rejects; empty when nothing.

    >>> problems_in(Path("x.py"), "import imp")
    ['x.py:1: imports imp (removed in Python 3.12/3.13)']
    """
    out: List[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(source, str(path))
        except SyntaxError as e:
            return [f"{path}:{e.lineno}: does not compile: {e.msg}"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a SyntaxWarning (3.12) or DeprecationWarning (<= 3.11)
        try:                            # comes back as a SyntaxError
            compile(source, str(path), "exec", dont_inherit=True)
        except (SyntaxError, SyntaxWarning, DeprecationWarning) as e:
            out.append(f"{path}:{getattr(e, 'lineno', None) or '?'}: does not compile with "
                       f"warnings as errors: {getattr(e, 'msg', e)}")
    setup_py = path.name == "setup.py"
    for node in ast.walk(tree):
        names: Iterable[str] = ()
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in REMOVED_MODULES:
                out.append(f"{path}:{node.lineno}: imports {name} (removed in Python 3.12/3.13)")
            elif top in NOT_IN_A_312_VENV and not setup_py:
                out.append(f"{path}:{node.lineno}: imports {name} (not in a Python 3.12 venv)")
        if isinstance(node, ast.Attribute):
            if node.attr in REMOVED_ATTRIBUTES:
                out.append(f"{path}:{node.lineno}: uses .{node.attr} (removed in Python 3.12)")
            elif (isinstance(node.value, ast.Name)
                  and (node.value.id, node.attr) in REMOVED_QUALIFIED):
                out.append(f"{path}:{node.lineno}: uses {node.value.id}.{node.attr} "
                           "(removed in Python 3.12)")
        if isinstance(node, ast.FunctionDef) and node.name in ("find_module", "find_loader",
                                                                 "load_module"):
            out.append(f"{path}:{node.lineno}: defines {node.name} (Python 3.12 never calls it)")
    return out


def tracked_python_files(root: Path) -> List[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True,
                            check=True).stdout.split()
    return [root / p for p in listed]


def main(argv: List[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    paths = [Path(p) for p in argv] or tracked_python_files(root)
    found: List[str] = []
    for path in paths:
        found += problems_in(path, path.read_text(encoding="utf-8"))
    for line in found:
        print(line)
    print(f"check_py312: {len(paths)} files, {len(found)} problems "
          f"(checked on Python {sys.version.split()[0]})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
