"""``python -m torch_pipeline.sim run [options] script.py [args...]`` (or ``-m module``): runs an
unmodified CUDA program on sim devices (:func:`torch_pipeline.sim.as_cuda`) and reports its stream
races with the Python lines of both accesses. Exit status: the program's own when it failed,
otherwise 1 when races were found, 0 when none.

    python -m torch_pipeline.sim run --devices 2 train.py --epochs 1
    python -m torch_pipeline.sim run --async --junit races.xml -m my_package.train
    python -m torch_pipeline.sim run --compare train.py   # asynchronous, then its outputs vs sync
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import subprocess
import sys
import traceback
from typing import List, Optional, TextIO, Tuple


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_pipeline.sim",
        description="Race-check a CUDA program's streams on the sim device, without a GPU.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a CUDA script or module on sim devices",
                         description="Runs the program with 'cuda' mapped to sim devices and "
                                     "prints a report of its stream races at exit.")
    run.add_argument("--devices", type=int, default=2, help="number of CUDA devices (default 2)")
    run.add_argument("--async", dest="asynchronous", action="store_true",
                     help="asynchronous mode: kernels run on stream threads, so a missing wait "
                          "also gives wrong values")
    run.add_argument("--strict", action="store_true",
                     help="the first racing op raises torch_pipeline.sim.RaceError")
    run.add_argument("--compare", action="store_true",
                     help="asynchronous mode (each kernel taking 200 us on its stream), then a "
                          "synchronous rerun of the program (a child process): the lines of its "
                          "output that differ are printed, and the exit status is 1 if any do "
                          "(wrong values from a missing wait)")
    run.add_argument("--junit", metavar="PATH", help="also write the races as JUnit XML")
    run.add_argument("--no-stacks", dest="stacks", action="store_false",
                     help="do not capture Python stacks (faster; reports name ops only)")
    run.add_argument("-m", dest="module", metavar="MODULE",
                     help="run a module, as python -m (the arguments after it are its own)")
    run.add_argument("program", nargs="?", metavar="script.py",
                     help="the script to run (the arguments after it are its own)")
    return p


def _split(argv: List[str]) -> Tuple[List[str], List[str]]:
    """Our arguments, and the program's: everything after the script or after ``-m MODULE``."""
    for i, arg in enumerate(argv):
        if arg == "-m":
            return argv[:i + 2], argv[i + 2:]
        if i > 0 and not arg.startswith("-") and argv[i - 1] not in ("--devices", "--junit"):
            return argv[:i + 1], argv[i + 1:]
    return argv, []


class _Tee(io.TextIOBase):
    """The program's standard output, passed on and kept (for --compare)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()


_RERUN = "_TORCH_PIPELINE_SIM_COMPARE_RERUN"
_COMPARE_LAUNCH_US = 200.0  # the asynchronous run's latency per kernel (sim.set_latency)
_SEED = "_TORCH_PIPELINE_SIM_COMPARE_SEED"


def _seed(seed: Optional[int]) -> None:
    """Both runs of --compare draw the same random numbers: torch's generator (which sim ops
    draw from too), Python's and NumPy's, seeded alike (with torch's own initial seed, unless
    given)."""
    import random

    import torch

    if seed is None:
        seed = int(torch.initial_seed())
        os.environ[_SEED] = str(seed)
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def _synchronous_rerun(args: argparse.Namespace) -> "subprocess.CompletedProcess[str]":
    """The program run again in synchronous mode, in a child process: its output."""
    command = [sys.executable, "-m", "torch_pipeline.sim", "run", "--devices", str(args.devices),
               "--no-stacks"]
    if args.module is not None:
        command += ["-m", args.module]
    command += list(args.program)
    # (its exit status: the program's own only; its random numbers: the first run's)
    env = dict(os.environ, **{_RERUN: "1", _SEED: os.environ[_SEED]})
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)


def _compare(ours: str, rerun: "subprocess.CompletedProcess[str]") -> Tuple[str, bool]:
    """What --compare prints, and whether the outputs differ."""
    mine, theirs = ours.splitlines(), rerun.stdout.splitlines()
    differ = [(i, a, b) for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    lines = [f"line {i + 1}: {a}\n  synchronous: {b}" for i, a, b in differ]
    if len(mine) != len(theirs):
        lines.append(f"{len(mine)} line(s) here, {len(theirs)} in the synchronous rerun")
    head = "torch_pipeline.sim --compare: "
    if rerun.returncode != 0 and not lines:
        return head + f"the synchronous rerun failed (exit status {rerun.returncode})", True
    if not lines:
        return head + f"the output equals a synchronous rerun's ({len(mine)} line(s))", False
    return (head + f"{len(differ)} line(s) of the output differ from a synchronous rerun's "
            "(values a missing wait made wrong):\n" + "\n".join(lines)), True


def main(argv: Optional[List[str]] = None) -> int:
    ours, theirs = _split(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(ours)
    if args.module is None and args.program is None:
        _parser().error("run: give a script (script.py [args...]) or -m module [args...]")
    args.program = ([] if args.program is None else [args.program]) + theirs

    import torch_pipeline.sim as sim
    from torch_pipeline.sim._as_cuda import stream_aliases

    if args.module is not None:
        sys.argv = [args.module] + list(args.program)
    else:
        script = args.program[0]
        if not os.path.exists(script):
            print(f"python -m torch_pipeline.sim: can't open file {script!r}", file=sys.stderr)
            return 2
        sys.argv = list(args.program)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))

    status = 0
    tee: Optional[_Tee] = None
    if args.compare:
        args.asynchronous = True
        tee = _Tee(sys.stdout)
        _seed(None)
    elif _SEED in os.environ:
        _seed(int(os.environ[_SEED]))
    with sim.as_cuda(devices=args.devices, asynchronous=args.asynchronous, strict=args.strict,
                     stacks=args.stacks), contextlib.redirect_stdout(tee or sys.stdout):
        if args.compare:
            # Every kernel takes this long on its stream, so the window a missing wait leaves
            # open is open at every run (on a fast queue thread a read might come after it).
            sim.set_latency(launch_us=_COMPARE_LAUNCH_US)
        try:
            if args.module is not None:
                runpy.run_module(args.module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the program's failure is reported, then ours
            traceback.print_exc()
            status = 1
        races = sim.races()
        text = sim.report(races, cuda_names=True)
        aliases = stream_aliases()
        if aliases:
            text = "\n\n".join(f"stream alias {i + 1} of {len(aliases)}: {a}"
                                for i, a in enumerate(aliases)) + "\n\n" + text
        if args.junit:
            from ._report import write_junit
            write_junit(args.junit, races, cuda_names=True)
    print(text, file=sys.stderr)
    if status == 0 and races and _RERUN not in os.environ:
        status = 1
    if tee is not None:
        sys.stdout.flush()
        compared, differ = _compare(tee.kept.getvalue(), _synchronous_rerun(args))
        print(compared, file=sys.stderr)
        if status == 0 and differ:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
