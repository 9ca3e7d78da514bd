"""Race reports a person can act on: the Python lines of both accesses, the tensor, the streams,
what would fix it; one entry per pair of code locations (:func:`report`, :func:`group_races`)."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import sysconfig
import weakref
import xml.etree.ElementTree as ET
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import _C

Frame = Tuple[str, int, str]  # (file, line, function)

_TORCH_DIR = os.path.dirname(os.path.abspath(str(torch.__file__))) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIRS = tuple(
    os.path.abspath(p) + os.sep
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


# Test runners whose frames sit between a test and its caller: not the program's code either.
_HARNESSES = ("_pytest", "pluggy")


def _harness_dirs() -> Tuple[str, ...]:
    dirs = []
    for name in _HARNESSES:
        filename = getattr(sys.modules.get(name), "__file__", None)
        if filename:
            dirs.append(os.path.dirname(os.path.abspath(filename)) + os.sep)
    return tuple(dirs)


def _is_user_frame(frame: Frame) -> bool:
    filename = frame[0]
    if filename.startswith("<"):  # <frozen runpy>, <string>
        return False
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _OWN_DIR) + _harness_dirs()):
        return False
    return not (path.startswith(_STDLIB_DIRS) and "site-packages" not in path)


def user_frames(stack: Sequence[Frame]) -> List[Frame]:
    """The frames of ``stack`` (innermost first) in the program's own code: not torch's, not
    torch_pipeline's, not the standard library's."""
    return [f for f in stack if _is_user_frame(f)]


_FORMATTED_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)')


def forward_frames(formatted: Sequence[str]) -> List[Frame]:
    """Frames (innermost first) from ``traceback.format_stack()`` text (outermost first), as
    anomaly mode keeps the forward stack of an autograd node."""
    frames = []
    for entry in formatted:
        m = _FORMATTED_FRAME.match(entry)
        if m:
            frames.append((m.group("file"), int(m.group("line")), m.group("fn").strip()))
    return frames[::-1]


def access_frames(race: "_C.SimRace", which: str) -> List[Frame]:
    """The program's frames of the earlier or later access (``which``), innermost first: the
    stack that called the op, or for an op of a backward pass, the stack of its forward (when
    anomaly mode kept it)."""
    backward = getattr(race, which + "_backward")
    if backward is not None:
        frames = user_frames(forward_frames(backward[1]))
        if frames:
            return frames
    return user_frames(getattr(race, which + "_stack"))


def _where_of(race: "_C.SimRace", which: str) -> str:
    frames = access_frames(race, which)
    return f"{frames[0][0]}:{frames[0][1]}" if frames else ""


@dataclasses.dataclass
class RaceReport:
    """The races of one pair of code locations (the first race stands for them all)."""

    race: "_C.SimRace"
    count: int
    key: Tuple[str, ...]

    @property
    def earlier_location(self) -> str:
        """``file:line`` of the earlier access in the program's code ("" when unknown)."""
        return _where_of(self.race, "earlier")

    @property
    def later_location(self) -> str:
        return _where_of(self.race, "later")


def group_races(races: Iterable["_C.SimRace"]) -> List[RaceReport]:
    """Races grouped by the pair of code locations of their accesses (or, without stacks, by
    their ops and streams), in the order first seen."""
    groups: Dict[Tuple[str, ...], RaceReport] = {}
    for race in races:
        earlier, later = _where_of(race, "earlier"), _where_of(race, "later")
        if earlier or later:
            key: Tuple[str, ...] = (earlier, later)
        else:
            key = (race.earlier_op, race.earlier_stream, race.later_op, race.later_stream)
        if key in groups:
            groups[key].count += 1
        else:
            groups[key] = RaceReport(race, 1, key)
    return list(groups.values())


class _ParameterNamer:
    """A global forward pre-hook that names the storages of a module's parameters and buffers
    (for race reports: ``= Linear.weight``) the first time the module runs, from the outermost
    module that runs it (its submodules are named then too)."""

    def __init__(self) -> None:
        self.seen: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if module in self.seen:
            return
        with torch._C.DisableTorchFunction():  # the real devices
            prefix = type(module).__name__
            named = [(t, name) for name, t in
                     list(module.named_parameters(prefix=prefix, remove_duplicate=False)) +
                     list(module.named_buffers(prefix=prefix, remove_duplicate=False))
                     if t is not None and t.device.type == "sim"]
            _C._sim_name_storages(named)
        for m in module.modules():
            self.seen.add(m)


_namer_handle: Optional[Any] = None


def name_module_storages(on: bool) -> None:
    """Installs (or removes) the hook of :class:`_ParameterNamer`."""
    global _namer_handle
    if on and _namer_handle is None:
        _namer_handle = torch.nn.modules.module.register_module_forward_pre_hook(
            _ParameterNamer())
    elif not on and _namer_handle is not None:
        _namer_handle.remove()
        _namer_handle = None


def _fix(race: "_C.SimRace") -> str:
    earlier, later = race.earlier_stream, race.later_stream
    if race.later_op.startswith("allocation (reuses"):
        return (f"the memory was freed while {earlier} still used it, and handed out again: "
                f"call tensor.record_stream(<that stream>) on the tensor {earlier} used before "
                f"dropping it, or keep the tensor alive until that stream is synchronized (a "
                f"torch_pipeline pipeline does both for you)")
    if later == "host":
        return (f"the host used memory that {earlier} had not finished with (a non_blocking "
                f"copy): synchronize before reading it on the host (the stream's or an event's "
                f"synchronize(), torch.cuda.synchronize()), or use torch_pipeline.item_async")
    access = "write" if race.later_write else "read"
    return (f"{later} does not wait for {earlier}: before the {access}, make it wait "
            f"(<later stream>.wait_stream(<earlier stream>), or record an Event on the earlier "
            f"stream and wait on it), or run both under torch_pipeline pipelines, which insert "
            f"the wait")


def _stack_lines(race: "_C.SimRace", which: str, limit: int = 4) -> List[str]:
    lines = []
    backward = getattr(race, which + "_backward")
    frames = access_frames(race, which)
    if backward is not None:
        called = user_frames(getattr(race, which + "_stack"))
        how = f"      in the backward of {backward[0]}"
        if backward[1]:
            how += " (made by the forward at these lines)"
        elif called:
            how += f", from backward() at {called[0][0]}:{called[0][1]}"
        else:
            how += " (run with anomaly mode for the forward's lines)"
        lines.append(how)
        if not backward[1]:
            frames = []
    elif not frames:
        return ["      (no Python frames: a C++ thread, or stacks were off)"]
    lines += [f"      {f[0]}:{f[1]} in {f[2]}" for f in frames[:limit]]
    if len(frames) > limit:
        lines.append(f"      ... {len(frames) - limit} more frame(s)")
    return lines


def _format_one(number: int, total: int, rep: RaceReport, cuda_names: bool) -> str:
    r = rep.race
    later = "write" if r.later_write else "read"
    earlier = "write" if r.earlier_write else "read"
    seen = f" (seen {rep.count} times)" if rep.count > 1 else ""
    lines = [
        f"race {number} of {total}{seen}: {r.memory}",
        f"  {later} by {r.later_op} on {r.later_stream}, at",
        *_stack_lines(r, "later"),
        f"  is not ordered after the {earlier} by {r.earlier_op} on {r.earlier_stream}, at",
        *_stack_lines(r, "earlier"),
        f"  fix: {_fix(r)}",
    ]
    text = "\n".join(lines)
    return text.replace("sim:", "cuda:") if cuda_names else text


def report(races: Optional[Sequence["_C.SimRace"]] = None, *, cuda_names: bool = False) -> str:
    """A readable report of ``races`` (default: every race found so far), one entry per pair of
    code locations, and a summary line. ``cuda_names`` names devices ``cuda:N`` (as the program
    did under :func:`as_cuda`).

        >>> sim.set_report_stacks(True)
        >>> ...                       # the program
        >>> print(sim.report())
    """
    found = list(_C._sim_races()) if races is None else list(races)
    if not found:
        return "torch_pipeline.sim: no races"
    groups = group_races(found)
    parts = [_format_one(i + 1, len(groups), g, cuda_names) for i, g in enumerate(groups)]
    parts.append(f"torch_pipeline.sim: {len(found)} race(s) at {len(groups)} pair(s) of code "
                 f"locations")
    return "\n\n".join(parts)


def write_junit(path: str, races: Sequence["_C.SimRace"], *, cuda_names: bool = False,
                suite: str = "torch_pipeline.sim") -> None:
    """A JUnit XML file with a failing test case per pair of code locations (a passing one when
    there are no races), for CI systems that show such files."""
    groups = group_races(races)
    root = ET.Element("testsuite", name=suite, tests=str(max(1, len(groups))),
                      failures=str(len(groups)))
    if not groups:
        ET.SubElement(root, "testcase", classname=suite, name="no races")
    for i, g in enumerate(groups):
        case = ET.SubElement(root, "testcase", classname=suite,
                             name=f"race at {g.later_location or g.race.later_op} after "
                                  f"{g.earlier_location or g.race.earlier_op}")
        message = f"{g.race.later_op} races with {g.race.earlier_op}"
        failure = ET.SubElement(case, "failure",
                                message=message.replace("sim:", "cuda:") if cuda_names else message)
        failure.text = _format_one(i + 1, len(groups), g, cuda_names)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
