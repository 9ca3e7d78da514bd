"""Sphinx configuration: the API reference, generated from the docstrings (scripts/build_docs.sh).

The guides are Markdown files read on GitHub (README.md, guide.md, design.md); Sphinx builds only
the reference (index.rst, api/*.rst) from the installed package, with warnings as errors.
"""
import torch_pipeline

project = "torch_pipeline"
release = torch_pipeline.__version__
version = release
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext"}
exclude_patterns = ["_build", "*.md"]
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"

