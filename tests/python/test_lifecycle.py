"""Process-level lifecycle of torch_pipeline: interpreter exit, shutdown, fork and Ctrl-C.

Every scenario runs in a child interpreter (``sys.executable``) with a timeout, because each one
either ends the process or changes state that cannot be undone (the runtime's shutdown, fork).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import IO

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uses fork and POSIX signals")

TIMEOUT_S = 60.0
# Starting an interpreter and importing torch takes ~1.5 s here, more on a loaded machine; the
# exit-time checks are measured from the end of the child's script, not from its start.
_IMPORT_ALLOWANCE_S = 10.0


def _child_env(**extra: str) -> dict[str, str]:
    """The test's environment without torch_pipeline settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _run_script(
    source: str, *, timeout: float = TIMEOUT_S, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs ``source`` in a fresh interpreter; returns the result and the wall time it took."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(**env),
    )
    return proc, time.monotonic() - start


def _start_script(source: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(**env),
    )


def _read_line(stream: IO[str], proc: subprocess.Popen[str]) -> str:
    """The child's next stdout line; the child is killed if none comes within TIMEOUT_S."""
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        line = stream.readline()
    finally:
        watchdog.cancel()
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=TIMEOUT_S)
        pytest.fail(f"child ended before printing a line; stderr:\n{err}")
    return line.strip()


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


# ---- interpreter exit ------------------------------------------------------------------------
def test_exit_finishes_running_and_queued_tasks_in_order() -> None:
    """At interpreter exit the running task and all queued tasks finish, in FIFO order."""
    proc, _ = _run_script(
        """
        import time
        import torch_pipeline as tp

        p = tp.Pipeline()

        def slow() -> None:
            time.sleep(0.3)
            print("RUNNING-DONE", flush=True)

        p.submit(slow)
        for i in range(5):
            p.submit(print, f"QUEUED-{i}", flush=True)
        # no wait: the script ends with one task running and five queued
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["RUNNING-DONE"] + [f"QUEUED-{i}" for i in range(5)]
    assert "cancelled" not in proc.stderr


def test_exit_timeout_cancels_queued_tasks_and_abandons_running_one() -> None:
    """TORCH_PIPELINE_EXIT_TIMEOUT bounds the exit wait: queued tasks are cancelled, not run."""
    proc, elapsed = _run_script(
        """
        import time
        import torch_pipeline as tp

        p = tp.Pipeline()

        def slow() -> None:
            time.sleep(5)
            print("RUNNING-DONE", flush=True)

        p.submit(slow)
        for i in range(5):
            p.submit(print, f"QUEUED-{i}", flush=True)
        print("SCRIPT-END", time.monotonic(), flush=True)
        """,
        TORCH_PIPELINE_EXIT_TIMEOUT="0.2",
    )
    ended = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable with the child's
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 4.5 + _IMPORT_ALLOWANCE_S, f"the child ran {elapsed:.2f} s"
    lines = _lines(proc.stdout)
    assert len(lines) == 1 and lines[0].startswith("SCRIPT-END "), lines
    exit_duration = ended - float(lines[0].split()[1])
    assert exit_duration < 4.5, f"exit took {exit_duration:.2f} s despite a 0.2 s exit timeout"
    assert "cancelled" in proc.stderr
    assert "5 queued task" in proc.stderr
    assert "abandoned" in proc.stderr


def test_exit_timeout_cancelled_futures_raise_runtime_error() -> None:
    """Tasks cancelled by a bounded shutdown complete their futures with a RuntimeError."""
    proc, _ = _run_script(
        """
        import threading
        import torch_pipeline as tp

        p = tp.Pipeline()
        gate = threading.Event()
        running = p.submit(gate.wait, 30)
        queued = [p.submit(print, f"QUEUED-{i}", flush=True) for i in range(3)]
        cancelled = tp._C._shutdown(0.1)
        print("CANCELLED", cancelled, flush=True)
        for fut in queued:
            try:
                fut.wait()
                print("NO-ERROR", flush=True)
            except RuntimeError as e:
                print("ERROR", "cancelled" in str(e), flush=True)
        # the gate stays shut: the abandoned task never finishes (see the finalization test)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["CANCELLED 3"] + ["ERROR True"] * 3


def test_abandoned_task_finishing_during_finalization_does_not_crash() -> None:
    """A running task abandoned at exit (the exit timeout passed) that wakes up while the
    interpreter finalizes must not crash the process: exit code 0, not SIGABRT.

    The task blocks in torch's Future.wait (which, like most torch ops, releases the GIL in a
    C++ scope). An object torn down with the __main__ module completes that future during
    finalization and sleeps, so the task's thread tries to take the GIL back while the
    interpreter is finalizing: deterministic, no timing guesswork."""
    proc, _ = _run_script(
        """
        import time
        import torch
        import torch_pipeline as tp

        class Finisher:
            def __init__(self, fut: torch.futures.Future) -> None:
                self.fut = fut

            def __del__(self) -> None:  # runs during module teardown, after atexit handlers
                self.fut.set_result(1)  # the abandoned task wakes up now
                time.sleep(0.5)

        inner = torch.futures.Future()
        tp.Pipeline().submit(inner.wait)
        finisher = Finisher(inner)
        print("SCRIPT-END", flush=True)
        """,
        TORCH_PIPELINE_EXIT_TIMEOUT="0.1",
    )
    assert _lines(proc.stdout) == ["SCRIPT-END"]
    assert "1 running task(s) abandoned" in proc.stderr
    assert proc.returncode == 0, (
        f"exit code {proc.returncode} (-6 is SIGABRT); stderr:\n{proc.stderr}"
    )


def test_task_submitting_tasks_during_exit_drain_still_runs() -> None:
    """A task running at exit may submit more tasks (and wait for them): they all run."""
    proc, _ = _run_script(
        """
        import time
        import torch_pipeline as tp

        p = tp.Pipeline()
        other = tp.Pipeline(1)

        def second() -> int:
            print("SECOND-RAN", flush=True)
            return 7

        def third() -> None:
            print("THIRD-RAN", flush=True)

        def first() -> None:
            time.sleep(0.3)  # the main thread is in the exit handler by now
            fut = other.submit(second)
            print("FIRST-GOT", fut.wait(), flush=True)
            p.submit(third)  # queued behind this task on the same worker, not waited for

        p.submit(first)
        print("MAIN-END", flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["MAIN-END", "SECOND-RAN", "FIRST-GOT 7", "THIRD-RAN"]


def test_submit_after_shutdown_raises_shutting_down() -> None:
    """After the runtime shut down, submit() raises a RuntimeError saying it is shutting down."""
    proc, _ = _run_script(
        """
        import torch_pipeline as tp

        p = tp.Pipeline()
        done = p.submit(lambda: 41 + 1)
        tp._C._shutdown()
        print("BEFORE", done.wait(), flush=True)
        for target in (p, tp.Pipeline()):
            try:
                target.submit(lambda: 1)
                print("ACCEPTED", flush=True)
            except RuntimeError as e:
                print("REFUSED", "shutting down" in str(e), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["BEFORE 42", "REFUSED True", "REFUSED True"]


_DAEMONS_AT_EXIT = """
import gc, os, random, sys, threading, time
import torch
import torch_pipeline as tp

RUNS, SIM = int(sys.argv[1]), sys.argv[2] == "sim"
if SIM:
    import torch_pipeline.sim as sim
    sim.enable(num_devices=1)


def daemon(seed: int) -> None:
    # Only torch_pipeline calls (with sim, small ops under its pipeline) until the process ends.
    r = random.Random(seed)
    p = tp.Pipeline()
    x = torch.ones(64, device="sim:0") if SIM else None
    while True:
        what = r.randrange(5)
        if what == 0:
            try:
                p.submit(time.sleep, r.random() * 0.002).wait()
            except RuntimeError:  # refused once the exit handler runs: carry on regardless
                pass
        elif what == 1:
            p.synchronize()
        elif what == 2:
            p.record_event()
        elif what == 3:
            p = tp.Pipeline()
        else:
            tp.synchronize()
        if SIM:
            with tp.pipeline(p):
                x = x * 1.001 + 1


def finish(run: int) -> None:
    time.sleep(0.02)
    os.write(1, f"TASK-DONE {run}\\n".encode())


def child(run: int) -> None:
    random.seed(run)
    if SIM:
        sim.set_asynchronous(run % 4 == 3)  # (its exit drains the queued ops: slower)
    for k in range(4):
        threading.Thread(target=daemon, args=(run * 10 + k,), daemon=True).start()
    time.sleep(random.random() * 0.05)
    tp.Pipeline().submit(finish, run)  # queued at exit: it still runs
    sys.exit(10 + run)


def stack_of(pid: int) -> str:
    # Where a hung child is stuck, for the failure message (gdb, when the machine has it).
    import subprocess
    try:
        return subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                              capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"(no stack: {e!r})"


# Each run is a forked child that goes through interpreter exit: cheaper than a fresh interpreter,
# and cheaper still with the imports frozen out of the collector; four run at a time. A child
# still there after 30 s is hung: its stack goes to stderr and it is killed.
gc.freeze()
running = {}
for run in range(RUNS):
    pid = os.fork()
    if pid == 0:
        child(run)
    running[pid] = (run, time.monotonic())
    if len(running) == 4 or run == RUNS - 1:
        while running:
            for pid, (r, started) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    print("RUN", r, os.waitstatus_to_exitcode(status), flush=True)
                    del running[pid]
                elif time.monotonic() - started > 30:
                    print(f"HUNG run {r}:", stack_of(pid)[-20000:], file=sys.stderr, flush=True)
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    del running[pid]
            time.sleep(0.005)
"""


@pytest.mark.parametrize("ops", ["none", "sim"])
def test_exit_with_daemon_threads_in_torch_pipeline_calls(ops: str) -> None:
    """Daemon threads blocked in or entering torch_pipeline calls (submit and wait, synchronize,
    record_event, new pipelines; with and without sim ops, sim synchronous and asynchronous)
    while the main thread returns, at random moments: each of 20 runs exits with the main
    thread's status, after its queued task ran, never with SIGABRT ("terminate called without an
    active exception": Python ended a daemon thread taking the GIL back inside a noexcept
    destructor, Note [threads at exit] in csrc/python/gil.cpp)."""
    runs = 20
    proc = subprocess.run([sys.executable, "-c", _DAEMONS_AT_EXIT, str(runs), ops],
                          capture_output=True, text=True, timeout=240, env=_child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HUNG" not in proc.stderr, proc.stderr[-20000:]
    lines = _lines(proc.stdout)
    codes = {int(l.split()[1]): int(l.split()[2]) for l in lines if l.startswith("RUN")}
    assert codes == {run: 10 + run for run in range(runs)}, (codes, proc.stderr[-3000:])
    assert sorted(l for l in lines if l.startswith("TASK-DONE")) == sorted(
        f"TASK-DONE {run}" for run in range(runs))
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]


# ---- fork ------------------------------------------------------------------------------------
def test_fork_child_gets_fresh_runtime_and_rejects_parent_objects() -> None:
    """After fork: new Pipelines work in the child; the parent's Pipeline and unfinished futures
    raise RuntimeError naming fork (no hang); the parent keeps working."""
    proc, _ = _run_script(
        """
        import os
        import threading
        import torch_pipeline as tp

        p = tp.Pipeline()
        assert p.submit(lambda: 41 + 1).wait() == 42  # the worker thread exists now
        gate = threading.Event()
        blocked = p.submit(gate.wait, 30)  # not done at fork time
        pid = os.fork()
        if pid == 0:
            ok = True
            try:
                q = tp.Pipeline()
                value = q.submit(lambda a, b: a * b, 6, 7).wait()
                print("CHILD-NEW", value, flush=True)
                ok = ok and value == 42
                try:
                    p.submit(lambda: 1)
                    print("CHILD-OLD-SUBMIT accepted", flush=True)
                    ok = False
                except RuntimeError as e:
                    print("CHILD-OLD-SUBMIT", "fork" in str(e), flush=True)
                    ok = ok and "fork" in str(e)
                try:
                    blocked.wait()
                    print("CHILD-OLD-FUTURE returned", flush=True)
                    ok = False
                except RuntimeError as e:
                    print("CHILD-OLD-FUTURE", "fork" in str(e), flush=True)
                    ok = ok and "fork" in str(e)
            except BaseException as e:
                print("CHILD-EXCEPTION", repr(e), flush=True)
                ok = False
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("CHILD-STATUS", os.waitstatus_to_exitcode(status), flush=True)
        gate.set()
        print("PARENT-BLOCKED", blocked.wait(), flush=True)
        print("PARENT-AFTER", p.submit(lambda: "ok").wait(), tp.Pipeline(1).submit(len, "abc").wait(),
              flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == [
        "CHILD-NEW 42",
        "CHILD-OLD-SUBMIT True",
        "CHILD-OLD-FUTURE True",
        "CHILD-STATUS 0",
        "PARENT-BLOCKED True",
        "PARENT-AFTER ok 3",
    ]


def test_fork_child_normal_exit_does_not_wait_for_parent_tasks() -> None:
    """A fork child that exits normally runs its own tasks at exit and does not wait for the
    parent's unfinished tasks (which do not exist in the child)."""
    proc, _ = _run_script(
        """
        import os
        import sys
        import threading
        import time
        import torch_pipeline as tp

        p = tp.Pipeline()
        gate = threading.Event()
        p.submit(gate.wait, 30)
        p.submit(print, "PARENT-QUEUED", flush=True)
        pid = os.fork()
        if pid == 0:
            tp.Pipeline().submit(print, "CHILD-TASK", flush=True)
            sys.exit(0)  # atexit drain in the child
        start = time.monotonic()
        _, status = os.waitpid(pid, 0)
        print("CHILD-STATUS", os.waitstatus_to_exitcode(status), flush=True)
        print("CHILD-QUICK", time.monotonic() - start < 20, flush=True)
        gate.set()
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["CHILD-TASK", "CHILD-STATUS 0", "CHILD-QUICK True", "PARENT-QUEUED"]


def test_fork_child_every_method_of_a_parent_pipeline_names_fork() -> None:
    """In a fork child, every method of a parent's pipeline raises the RuntimeError that names
    fork, at once: none hangs (synchronize used to wait for the parent's task forever) or answers
    as if the pipeline were usable (query used to return False)."""
    proc, _ = _run_script(
        """
        import os
        import signal
        import torch_pipeline as tp

        p = tp.Pipeline()
        other = tp.Pipeline(1)
        assert p.submit(lambda: 1).wait() == 1  # p has a finished task, its worker thread exists
        event = tp.PipelineEvent()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child (and fails the test)
            fresh = tp.Pipeline()

            def entered():
                with p:
                    pass

            uses = {
                "query": p.query,
                "synchronize": p.synchronize,
                "submit": lambda: p.submit(lambda: 1),
                "stream": p.stream,
                "record_event": p.record_event,
                "wait_event": lambda: p.wait_event(event),
                "wait_pipeline": lambda: p.wait_pipeline(fresh),
                "wait_pipeline_other": lambda: fresh.wait_pipeline(p),
                "wait_pipeline_self": lambda: p.wait_pipeline(p),
                "enter": entered,
                "pipeline": lambda: tp.pipeline(p),
                "set_pipeline": lambda: tp.set_pipeline(p),
                "decorate": lambda: p(print),
                "event_record": lambda: tp.PipelineEvent().record(p),
                "event_wait": lambda: event.wait(p),
                "streams": p._streams,
                "other_synchronize": other.synchronize,
            }
            ok = True
            for name, use in uses.items():
                try:
                    use()
                    print("ACCEPTED", name, flush=True)
                    ok = False
                except RuntimeError as e:
                    if "fork" not in str(e):
                        print("WRONG-ERROR", name, e, flush=True)
                        ok = False
            ok = ok and fresh.submit(lambda: 6 * 7).wait() == 42
            fresh.synchronize()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("CHILD-STATUS", os.waitstatus_to_exitcode(status), flush=True)
        p.synchronize()
        print("PARENT", p.query(), p.submit(lambda: "ok").wait(), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["CHILD-STATUS 0", "PARENT True ok"], proc.stdout


# ---- settings ----------------------------------------------------------------------------------
def test_bad_exit_timeout_is_a_value_error_naming_the_variable() -> None:
    """TORCH_PIPELINE_EXIT_TIMEOUT=soon: the exit still waits for every task (as when unset),
    then reports the ValueError of the settings reader (variable, value, what is allowed)."""
    proc, _ = _run_script(
        """
        import time
        import torch_pipeline as tp

        p = tp.Pipeline()
        p.submit(time.sleep, 0.2)
        p.submit(print, "QUEUED-RAN", flush=True)
        """,
        TORCH_PIPELINE_EXIT_TIMEOUT="soon",
    )
    assert _lines(proc.stdout) == ["QUEUED-RAN"]
    assert ("ValueError: TORCH_PIPELINE_EXIT_TIMEOUT='soon' is not a valid setting: expected a "
            "number of seconds >= 0") in proc.stderr, proc.stderr
    for bad in ("-1", "1s", "nan"):
        proc, _ = _run_script("import torch_pipeline", TORCH_PIPELINE_EXIT_TIMEOUT=bad)
        assert f"TORCH_PIPELINE_EXIT_TIMEOUT='{bad}' is not a valid setting" in proc.stderr, bad


def test_bad_debug_collectives_is_a_value_error_naming_the_variable() -> None:
    proc, _ = _run_script("import torch_pipeline", TORCH_PIPELINE_DEBUG_COLLECTIVES="yes")
    assert proc.returncode != 0
    assert ("ValueError: TORCH_PIPELINE_DEBUG_COLLECTIVES='yes' is not a valid setting: expected "
            "0 or 1") in proc.stderr, proc.stderr
    proc, _ = _run_script(
        """
        import torch_pipeline as tp
        print("DEBUG", tp._C._collective_debug(), flush=True)
        """,
        TORCH_PIPELINE_DEBUG_COLLECTIVES="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout) == ["DEBUG True"]


# ---- Ctrl-C ----------------------------------------------------------------------------------
# A child started by a runner that itself runs in the background (`cmd &` in a shell without job
# control, as CI scripts often are) inherits SIGINT ignored, and Python then installs no handler
# for it: the children below install Python's, as an interpreter started from a terminal has.
_AS_FROM_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
_WAIT_SCRIPT = _AS_FROM_A_TERMINAL + """
import os
import sys
import time
import torch_pipeline as tp

mode = sys.argv[1]
p = tp.Pipeline()
fut = p.submit(time.sleep, 30)
try:
    print("READY", flush=True)
    if mode == "future":
        fut.wait()
    elif mode == "pipeline":
        p.synchronize()
    else:
        tp.synchronize()
    print("RETURNED", flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["future", "pipeline", "global"])
def test_sigint_interrupts_blocking_wait(mode: str) -> None:
    """Ctrl-C raises KeyboardInterrupt in future.wait(), Pipeline.synchronize() and
    torch_pipeline.synchronize() while a 30 s task runs."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAIT_SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        assert proc.stdout is not None
        assert _read_line(proc.stdout, proc) == "READY"
        time.sleep(0.2)  # let it block in the wait
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)  # (the task sleeps 30 s; generous on a busy host)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert _lines(out) == ["INTERRUPTED"], err
    assert elapsed < 15
    assert proc.returncode == 0, err


def test_sigint_during_exit_wait_cancels_and_exits() -> None:
    """Ctrl-C while the exit handler waits for a long task: queued tasks are cancelled, the
    running one abandoned, the process ends promptly and says so on stderr."""
    proc = _start_script(
        _AS_FROM_A_TERMINAL
        + textwrap.dedent("""
        import atexit
        import time
        import torch_pipeline as tp

        p = tp.Pipeline()
        p.submit(time.sleep, 30)
        for i in range(3):
            p.submit(print, f"QUEUED-{i}", flush=True)
        # registered after torch_pipeline's handler, so it runs first (atexit is LIFO)
        atexit.register(print, "EXITING", flush=True)
        """)
    )
    try:
        assert proc.stdout is not None
        assert _read_line(proc.stdout, proc) == "EXITING"
        time.sleep(1.0)  # let the child reach torch_pipeline's exit wait (it takes microseconds)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert elapsed < 10
    assert "cancelled 3 queued task" in err, err
    assert "interrupted" in err
    assert "QUEUED" not in out
