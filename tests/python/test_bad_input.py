"""Bad input raises a clear Python exception that says what was expected; it never crashes or
hangs (docs/design.md, "The Python API and the rules users rely on")."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import torch_pipeline as tp


@dataclass(frozen=True)
class BadInput:
    """A call that must raise ``exc`` with a message matching ``pattern`` (re.search, DOTALL)."""

    name: str
    call: Callable[[tp.Pipeline], Any]  # gets a live non-default Pipeline
    exc: type[BaseException]
    pattern: str


def _cap() -> int:
    return tp.max_worker_threads()


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


WORKER_TYPE = r"worker_thread must be a torch_pipeline\.WorkerThread, an int or None.*"
EXPECTS_PIPELINE = r"expects a torch_pipeline\.Pipeline, got an object of type "

BAD_INPUTS: list[BadInput] = [
    # Pipeline(worker_thread, *, priority)
    BadInput("Pipeline('x')", lambda p: tp.Pipeline("x"), TypeError, WORKER_TYPE + "str"),
    BadInput("Pipeline(1.5)", lambda p: tp.Pipeline(1.5), TypeError, WORKER_TYPE + "float"),
    BadInput("Pipeline(True)", lambda p: tp.Pipeline(True), TypeError, WORKER_TYPE + "bool"),
    BadInput("Pipeline(-1)", lambda p: tp.Pipeline(-1), ValueError,
             r"worker thread id -1 is out of range: the cap is \d+"),
    BadInput("Pipeline(10**6)", lambda p: tp.Pipeline(10**6), ValueError,
             r"worker thread id 1000000 is out of range: the cap is \d+"),
    BadInput("Pipeline(cap)", lambda p: tp.Pipeline(_cap()), ValueError,
             r"out of range: the cap is \d+ worker threads.*set_max_worker_threads"),
    # an id that does not fit in 64 bits must still name the cap (docs/design.md, "Concepts")
    BadInput("Pipeline(10**30)", lambda p: tp.Pipeline(10**30), ValueError,
             r"out of range.*the cap is \d+"),
    BadInput("Pipeline(priority='high')", lambda p: tp.Pipeline(priority="high"), TypeError,
             r"priority must be an int, got an object of type str"),
    BadInput("Pipeline(priority=True)", lambda p: tp.Pipeline(priority=True), TypeError,
             r"priority must be an int, got an object of type bool"),
    BadInput("Pipeline(priority=10**9)", lambda p: tp.Pipeline(priority=10**9), ValueError,
             r"priority must be in \[-1024, 1024\].*got 1000000000"),
    # a priority that does not fit in 64 bits must not be accepted (as priority -1)
    BadInput("Pipeline(priority=10**30)", lambda p: tp.Pipeline(priority=10**30), ValueError,
             r"priority must be in \[-1024, 1024\]"),
    BadInput("Pipeline(priority=-10**30)", lambda p: tp.Pipeline(priority=-(10**30)), ValueError,
             r"priority must be in \[-1024, 1024\]"),
    # priority is keyword-only: say so, not pybind's "incompatible constructor arguments"
    BadInput("Pipeline(1, 0)", lambda p: tp.Pipeline(1, 0), TypeError,
             r"Pipeline\(worker_thread=None, \*, priority=0\) takes at most one positional "
             r"argument.*got 2; pass priority by keyword"),
    BadInput("Pipeline(prio=1)", lambda p: tp.Pipeline(prio=1), TypeError,
             r"got an unexpected keyword argument 'prio'"),
    # worker threads and the cap
    BadInput("get_worker_thread(cap)", lambda p: tp.get_worker_thread(_cap()), ValueError,
             r"worker thread id \d+ is out of range: the cap is \d+ worker threads \(ids 0\.\.\d+\)"),
    BadInput("get_worker_thread(-1)", lambda p: tp.get_worker_thread(-1), ValueError,
             r"worker thread id -1 is out of range: the cap is \d+"),
    BadInput("get_worker_thread('0')", lambda p: tp.get_worker_thread("0"), TypeError,
             r"get_worker_thread expects an int id, got an object of type str"),
    BadInput("get_worker_thread(10**30)", lambda p: tp.get_worker_thread(10**30), ValueError,
             r"out of range.*the cap is \d+"),
    BadInput("set_max_worker_threads(0)", lambda p: tp.set_max_worker_threads(0), ValueError,
             r"max worker threads must be in \[1, \d+\], got 0"),
    BadInput("set_max_worker_threads(-3)", lambda p: tp.set_max_worker_threads(-3), ValueError,
             r"max worker threads must be in \[1, \d+\], got -3"),
    BadInput("set_max_worker_threads('4')", lambda p: tp.set_max_worker_threads("4"), TypeError,
             r"set_max_worker_threads expects an int, got an object of type str"),
    BadInput("set_max_worker_threads(2000)", lambda p: tp.set_max_worker_threads(2000), ValueError,
             r"max worker threads must be in \[1, \d+\], got 2000"),
    BadInput("WorkerThread()", lambda p: tp.WorkerThread(), TypeError,
             r"not created directly.*get_worker_thread"),
    # contexts and foreign objects
    BadInput("pipeline('p')", lambda p: tp.pipeline("p"), TypeError, EXPECTS_PIPELINE + "str"),
    BadInput("pipeline(object())", lambda p: tp.pipeline(object()), TypeError,
             EXPECTS_PIPELINE + "object"),
    BadInput("pipeline(3)", lambda p: tp.pipeline(3), TypeError, EXPECTS_PIPELINE + "int"),
    BadInput("pipeline(torch.cuda.Stream)", lambda p: tp.pipeline(torch.cuda.Stream), TypeError,
             EXPECTS_PIPELINE),
    BadInput("pipeline(torch.device)", lambda p: tp.pipeline(torch.device("cpu")), TypeError,
             EXPECTS_PIPELINE + r"torch\.device"),
    BadInput("set_pipeline('x')", lambda p: tp.set_pipeline("x"), TypeError,
             r"set_pipeline " + EXPECTS_PIPELINE + "str"),
    BadInput("pipelined(3)", lambda p: tp.pipelined(3), TypeError,
             r"pipelined expects a torch_pipeline\.Pipeline, None, or a function.*got int"),
    BadInput("pipeline(None)(3)", lambda p: tp.pipeline(None)(3), TypeError,
             r"decorator needs a callable, got (an object of type )?int"),
    # bare @pipelined is for methods (self.pipeline): a function without self is refused at once
    BadInput("pipelined(lambda: 0)", lambda p: tp.pipelined(lambda: 0), TypeError,
             r"bare @torch_pipeline\.pipelined runs a method under self\.pipeline.*takes no self.*"
             r"@torch_pipeline\.pipelined\(p\)"),
    BadInput("pipelined(lambda *, k: 0)", lambda p: tp.pipelined(lambda *, k: 0), TypeError,
             r"takes no self argument"),
    # flags take bools only
    BadInput("PipelineEvent(enable_timing=2.0)", lambda p: tp.PipelineEvent(enable_timing=2.0),
             TypeError, r"enable_timing must be True or False, got an object of type float"),
    BadInput("PipelineEvent(enable_timing=None)", lambda p: tp.PipelineEvent(enable_timing=None),
             TypeError, r"enable_timing must be True or False, got an object of type NoneType"),
    BadInput("PipelineEvent(enable_timing=1)", lambda p: tp.PipelineEvent(enable_timing=1),
             TypeError, r"enable_timing must be True or False, got an object of type int"),
    # comm_stream checks its worker thread also on the CPU, where it returns None
    BadInput("comm_stream(worker_thread=99)", lambda p: tp.comm_stream(worker_thread=99),
             ValueError, r"worker thread id 99 is out of range: the cap is \d+"),
    BadInput("comm_stream(worker_thread='x')", lambda p: tp.comm_stream(worker_thread="x"),
             TypeError, WORKER_TYPE + "str"),
    BadInput("comm_stream(worker_thread=True)", lambda p: tp.comm_stream(worker_thread=True),
             TypeError, WORKER_TYPE + "bool"),
    BadInput("comm_stream(worker_thread=-1)", lambda p: tp.comm_stream(worker_thread=-1),
             ValueError, r"worker thread id -1 is out of range"),
    # Pipeline methods
    BadInput("submit(3)", lambda p: p.submit(3), TypeError,
             r"submit\(\) expects a callable as its first argument, got an object of type int"),
    BadInput("submit()", lambda p: p.submit(), TypeError, r"submit\(\).*\bfn\b"),
    BadInput("wait_event('e')", lambda p: p.wait_event("e"), TypeError,
             r"wait_event expects a torch_pipeline\.PipelineEvent, got an object of type str"),
    BadInput("wait_pipeline(3)", lambda p: p.wait_pipeline(3), TypeError,
             r"wait_pipeline " + EXPECTS_PIPELINE + "int"),
    BadInput("record_event(3)", lambda p: p.record_event(3), TypeError,
             r"record_event expects a torch_pipeline\.PipelineEvent or None, got an object of type int"),
    BadInput("PipelineEvent().record('p')", lambda p: tp.PipelineEvent().record("p"), TypeError,
             r"PipelineEvent\.record " + EXPECTS_PIPELINE + "str"),
    BadInput("PipelineEvent().wait('p')", lambda p: tp.PipelineEvent().wait("p"), TypeError,
             r"PipelineEvent\.wait " + EXPECTS_PIPELINE + "str"),
    BadInput("stream(True)", lambda p: p.stream(True), TypeError,
             r"device must be a torch\.device, a str, an int or None, got a bool"),
    BadInput("stream(1.5)", lambda p: p.stream(1.5), TypeError,
             r"device must be a torch\.device, a str, an int or None, got float"),
]

if _cuda_device_count() < 8:  # cuda:7 does not exist
    BAD_INPUTS.append(
        BadInput("stream('cuda:7')", lambda p: p.stream("cuda:7"), ValueError, r"device cuda:7")
    )
    BAD_INPUTS.append(
        BadInput("default.stream('cuda:7')",
                 lambda p: tp.default_pipeline().stream("cuda:7"), ValueError, r"device cuda:7")
    )
BAD_INPUTS.append(
    BadInput("stream('meta')", lambda p: p.stream("meta"), ValueError,
             r"device meta is not an accelerator")
)
# "sim" before torch_pipeline.sim.enable(): a hint, not torch's list of device types (sim tests
# run in child processes, so it is never enabled here)
BAD_INPUTS.append(
    BadInput("stream('sim:3') before sim.enable()", lambda p: p.stream("sim:3"), ValueError,
             r"device 'sim:3': the sim device is not enabled.*torch_pipeline\.sim\.enable")
)
if not torch.cuda.is_available():
    BAD_INPUTS.append(
        BadInput("stream(5)", lambda p: p.stream(5), ValueError,
                 r"device index 5 given, but no accelerator is available")
    )


@pytest.fixture
def pipe() -> tp.Pipeline:
    return tp.Pipeline()


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input_raises_clear_error(case: BadInput, pipe: tp.Pipeline) -> None:
    """Each bad input raises the expected exception type with a message that says what was
    expected."""
    with pytest.raises(case.exc) as info:
        case.call(pipe)
    assert type(info.value) is case.exc, f"{type(info.value).__name__}: {info.value}"
    assert re.search(case.pattern, str(info.value), re.S), str(info.value)
    # the interpreter and the runtime are still fine afterwards
    assert pipe.submit(lambda: 5).wait() == 5


def test_bad_inputs_in_fresh_interpreter_never_crash_or_hang() -> None:
    """The whole table, run first thing in a fresh interpreter (a bad call is the first use of
    the runtime), neither crashes nor hangs: every call returns to Python and the process exits
    normally. (The exception types and messages are checked by the parametrized test above.)"""
    here = Path(__file__).resolve().parent
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import test_bad_input as t

        class LazyPipeline:
            # makes the Pipeline only when a case uses it, so the bad calls come first
            _p = None
            def __getattr__(self, name):
                if LazyPipeline._p is None:
                    LazyPipeline._p = t.tp.Pipeline()
                return getattr(LazyPipeline._p, name)

        lazy = LazyPipeline()
        for case in t.BAD_INPUTS:
            try:
                case.call(lazy)
                print("RETURNED", case.name, flush=True)
            except Exception as e:
                print("RAISED", case.name, type(e).__name__, flush=True)
        print("SURVIVED", flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(here)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "SURVIVED"
    names = [line.split(" ", 1)[1].rsplit(" ", 1)[0] if line.startswith("RAISED")
             else line.split(" ", 1)[1] for line in lines[:-1]]
    assert names == [case.name for case in BAD_INPUTS]


# ---- behaviour that is not a plain bad argument ----------------------------------------------
def test_stream_of_cpu_is_none(pipe: tp.Pipeline) -> None:
    """p.stream('cpu') (and torch.device('cpu')) is None: the CPU has no streams."""
    assert pipe.stream("cpu") is None
    assert pipe.stream(torch.device("cpu")) is None
    assert tp.default_pipeline().stream("cpu") is None


def test_exiting_contexts_out_of_order_raises() -> None:
    """Exiting an outer pipeline context before the inner one raises RuntimeError naming the
    reverse order, and leaves the contexts intact so they can be closed properly."""
    p = tp.Pipeline()
    q = tp.Pipeline()
    p.__enter__()
    q.__enter__()
    try:
        with pytest.raises(RuntimeError, match="reverse order"):
            p.__exit__(None, None, None)
        assert tp.current_pipeline() == q
    finally:
        q.__exit__(None, None, None)
        p.__exit__(None, None, None)
    assert tp.current_pipeline() == tp.default_pipeline()


def test_exiting_unopened_context_raises() -> None:
    """Exiting a pipeline context that was never entered raises RuntimeError, not a crash."""
    p = tp.Pipeline()
    with pytest.raises(RuntimeError, match="not open on this thread"):
        p.__exit__(None, None, None)
    assert tp.current_pipeline() == tp.default_pipeline()


def test_pipelined_method_without_pipeline_attribute() -> None:
    """@tp.pipelined on a method of an object lacking .pipeline raises AttributeError that names
    'pipeline' and how to fix it."""

    class NoPipeline:
        @tp.pipelined
        def forward(self, x: int) -> int:
            return x + 1

    with pytest.raises(AttributeError, match=r"no attribute 'pipeline'.*Pipeline\(\)"):
        NoPipeline().forward(1)


def test_pipelined_method_with_wrong_pipeline_type() -> None:
    """@tp.pipelined where self.pipeline is not a Pipeline raises TypeError naming the type."""

    class WrongPipeline:
        pipeline = "p"

        @tp.pipelined
        def forward(self, x: int) -> int:
            return x + 1

    with pytest.raises(TypeError, match=r"WrongPipeline\.pipeline must be a torch_pipeline\.Pipeline or None, got str"):
        WrongPipeline().forward(1)


# ---- the worker-thread cap (fresh interpreters: the cap freezes on first use) ----------------
def _run_fresh(source: str, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env,
    )


def test_set_max_worker_threads_before_and_after_first_use() -> None:
    """Before first use set_max_worker_threads(n) sets the cap; after a Pipeline exists a
    different n raises RuntimeError and the same n is accepted."""
    proc = _run_fresh(
        """
        import torch_pipeline as tp
        tp.set_max_worker_threads(3)
        print("CAP", tp.max_worker_threads())
        tp.set_max_worker_threads(2)
        print("CAP", tp.max_worker_threads())
        p = tp.Pipeline(1)
        print("RAN", p.submit(lambda: 11).wait())
        try:
            tp.set_max_worker_threads(5)
            print("CHANGED")
        except RuntimeError as e:
            print("REFUSED", "before the first Pipeline" in str(e) and "cap of 2" in str(e))
        tp.set_max_worker_threads(2)
        print("SAME-OK", tp.max_worker_threads())
        try:
            tp.get_worker_thread(2)
            print("GOT-2")
        except ValueError as e:
            print("OUT-OF-RANGE", "the cap is 2" in str(e))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == [
        "CAP 3",
        "CAP 2",
        "RAN 11",
        "REFUSED True",
        "SAME-OK 2",
        "OUT-OF-RANGE True",
    ]


def test_env_cap_not_a_number_raises_value_error_on_first_use() -> None:
    """TORCH_PIPELINE_MAX_WORKER_THREADS=abc: import works, the first use raises a ValueError
    naming the variable, and the process still exits normally."""
    proc = _run_fresh(
        """
        import torch_pipeline as tp
        print("IMPORTED")
        for use in (tp.max_worker_threads, tp.Pipeline, lambda: tp.get_worker_thread(0)):
            try:
                use()
                print("NO-ERROR")
            except ValueError as e:
                print("VALUE-ERROR", "TORCH_PIPELINE_MAX_WORKER_THREADS='abc'" in str(e)
                      and "expected an integer" in str(e))
        """,
        TORCH_PIPELINE_MAX_WORKER_THREADS="abc",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["IMPORTED"] + ["VALUE-ERROR True"] * 3


def test_env_cap_sets_max_worker_threads() -> None:
    """TORCH_PIPELINE_MAX_WORKER_THREADS=6 gives a cap of 6: worker 5 exists, 6 does not."""
    proc = _run_fresh(
        """
        import torch_pipeline as tp
        print("CAP", tp.max_worker_threads())
        t = tp.get_worker_thread(5)
        print("ID", t.id)
        print("RAN", tp.Pipeline(t).submit(lambda: "five").wait())
        try:
            tp.get_worker_thread(6)
            print("GOT-6")
        except ValueError as e:
            print("OUT-OF-RANGE", "the cap is 6" in str(e))
        """,
        TORCH_PIPELINE_MAX_WORKER_THREADS="6",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["CAP 6", "ID 5", "RAN five", "OUT-OF-RANGE True"]
