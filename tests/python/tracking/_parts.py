"""Shared by the tests of the tracker's parts (docs/design.md, "The tracker's parts"): what each
part holds now, read under its lock through the test-only ``_C._tracker_parts()``."""
from __future__ import annotations

from typing import Dict


def part(name: str) -> Dict[str, int]:
    from torch_pipeline import _C

    return dict(_C._tracker_parts()[name])  # type: ignore[arg-type]


def period() -> int:
    from torch_pipeline import _C

    return int(_C._tracker_parts()["period"])  # type: ignore[arg-type]
