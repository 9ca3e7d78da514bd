"""What a newcomer hits in the first hour: async functions under a pipeline, futures read too
early, wait cycles across worker threads, device indices that would wrap, the example's --help,
and ``python -m torch_pipeline``."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List

import pytest

import torch_pipeline as tp

ROOT = Path(__file__).resolve().parents[2]
# Children run where they import the same torch_pipeline as this process: in the source tree for a
# build in place, elsewhere for an installed wheel (scripts/test_wheel.sh), as Python puts the
# working directory first on sys.path and the tree's copy of the package has no compiled module.
CHILD_CWD = ROOT if ROOT in Path(tp.__file__).resolve().parents else Path(tempfile.gettempdir())


def _run(source: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=CHILD_CWD)


# ---- async functions, async generators and async forward run under their pipeline -------------
def test_async_function_runs_under_pipeline_across_awaits() -> None:
    p = tp.Pipeline()
    seen: List[Any] = []
    other_seen: List[Any] = []

    @tp.pipeline(p)
    async def body() -> str:
        seen.append(tp.current_pipeline())
        await asyncio.sleep(0.01)
        seen.append(tp.current_pipeline())
        await asyncio.sleep(0)
        seen.append(tp.current_pipeline())
        return "done"

    async def other() -> None:  # runs between body's steps, on the same thread
        for _ in range(3):
            other_seen.append(tp.current_pipeline())
            await asyncio.sleep(0.005)

    async def main() -> Any:
        return await asyncio.gather(body(), other())

    assert asyncio.iscoroutinefunction(body)
    assert asyncio.run(main())[0] == "done"
    assert seen == [p, p, p]
    assert other_seen == [tp.default_pipeline()] * 3
    assert tp.current_pipeline() == tp.default_pipeline()


def test_async_function_exception_and_cancellation_restore_the_pipeline() -> None:
    p = tp.Pipeline()

    @tp.pipelined(p)
    async def fails() -> None:
        await asyncio.sleep(0)
        assert tp.current_pipeline() == p
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(fails())
    assert tp.current_pipeline() == tp.default_pipeline()

    cancelled_under: List[Any] = []

    @tp.pipelined(p)
    async def sleeper() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled_under.append(tp.current_pipeline())
            raise

    async def main() -> None:
        task = asyncio.ensure_future(sleeper())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tp.current_pipeline() == tp.default_pipeline()

    asyncio.run(main())
    assert cancelled_under == [p]


def test_async_generator_runs_under_pipeline_across_yields_and_awaits() -> None:
    p = tp.Pipeline()
    inside: List[Any] = []
    outside: List[Any] = []

    @tp.pipeline(p)
    async def numbers(n: int) -> AsyncIterator[int]:
        try:
            for i in range(n):
                inside.append(tp.current_pipeline())
                await asyncio.sleep(0)
                inside.append(tp.current_pipeline())
                yield i
        finally:
            inside.append(tp.current_pipeline())

    async def main() -> List[int]:
        out = []
        async for i in numbers(3):
            outside.append(tp.current_pipeline())
            out.append(i)
        agen = numbers(5)
        assert await agen.__anext__() == 0
        await agen.aclose()  # the finally block runs under p too
        return out

    assert asyncio.run(main()) == [0, 1, 2]
    assert inside and all(q == p for q in inside)
    assert outside == [tp.default_pipeline()] * 3


def test_async_forward_runs_under_self_pipeline() -> None:
    class Branch:
        def __init__(self) -> None:
            self.pipeline = tp.Pipeline()

        @tp.pipelined
        async def forward(self, x: int) -> Any:
            await asyncio.sleep(0)
            return x + 1, tp.current_pipeline()

    b = Branch()
    assert asyncio.run(b.forward(1)) == (2, b.pipeline)
    assert tp.current_pipeline() == tp.default_pipeline()


def test_bare_pipelined_on_plain_function_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"h\(\) takes no self argument.*pipelined\(p\)"):

        @tp.pipelined
        def h() -> None:
            pass


# ---- futures -----------------------------------------------------------------------------------
def test_value_of_unfinished_future_is_our_error_inside_and_outside_tasks() -> None:
    release = threading.Event()
    slow = tp.Pipeline(tp.get_worker_thread(2)).submit(release.wait, 30)
    try:
        with pytest.raises(RuntimeError, match=r"TaskFuture\.value\(\) was called before the task "
                                               r"finished.*wait\(\)"):
            slow.value()

        def read_early() -> str:
            try:
                slow.value()
            except RuntimeError as e:
                return str(e)
            return "no error"

        message = tp.Pipeline(tp.get_worker_thread(1)).submit(read_early).wait()
        assert "before the task finished" in message and "INTERNAL ASSERT" not in message
    finally:
        release.set()
    assert slow.wait() is True
    assert slow.value() is True


# ---- wait cycles across worker threads ---------------------------------------------------------
_CYCLE = """
import threading, torch_pipeline as tp
p1, p1b, p2 = tp.Pipeline(1), tp.Pipeline(1), tp.Pipeline(2)
ready = threading.Event()
futs = {}
def first():            # worker 1: waits for second() on worker 2
    ready.wait()
    return futs["second"].{wait}
def behind_first():     # worker 1, queued behind first()
    return "behind"
def second():           # worker 2: waits for behind_first(), which cannot run before first()
    ready.wait()
    return futs["behind"].{wait}
fa = p1.submit(first)
futs["behind"] = p1b.submit(behind_first)
futs["second"] = p2.submit(second)
ready.set()
errors = []
for f in (fa, futs["second"]):
    try:
        f.wait()
    except RuntimeError as e:
        errors.append(str(e))
assert futs["behind"].wait() == "behind"
print(len(errors))
print(errors[0])
"""


@pytest.mark.parametrize("how", ["wait()", "synchronize"])
def test_wait_cycle_across_worker_threads_raises_naming_the_pipelines(how: str) -> None:
    """A task on worker 1 waits for one on worker 2 that waits for a task queued behind the
    first on worker 1: one of the waits raises (naming the tasks and their pipelines) instead of
    hanging forever. With synchronize, the waits are Pipeline.synchronize() of the pipelines."""
    wait = "wait()" if how == "wait()" else "synchronize()"
    source = _CYCLE.replace("{wait}", wait)
    if how == "synchronize":
        source = source.replace('futs["second"].synchronize()', "p2.synchronize()")
        source = source.replace('futs["behind"].synchronize()', "p1b.synchronize()")
    proc = _run(source, timeout=60)  # a hang fails the test instead of the whole run
    assert proc.returncode == 0, proc.stderr
    count, message = proc.stdout.splitlines()[:2]
    # The task that closes the cycle raises; if that is second(), first() gets its exception too.
    assert count in ("1", "2")
    assert "cycle of waits across worker threads" in message
    assert "task first() of pipeline id=1 (priority 0) on worker thread 1" in message
    assert "task second() of pipeline id=1 (priority 0) on worker thread 2" in message
    assert "task behind_first() of pipeline id=2 (priority 0) on worker thread 1" in message


def test_waits_across_worker_threads_without_cycle_still_work() -> None:
    p1, p2, p3 = (tp.Pipeline(tp.get_worker_thread(i)) for i in (1, 2, 3))
    inner = p3.submit(lambda: 3)
    middle = p2.submit(lambda: inner.wait() + 2)
    assert p1.submit(lambda: middle.wait() + 1).wait() == 6


# ---- device indices never wrap (sim, in a child process) --------------------------------------
def test_out_of_range_device_indices_are_errors_naming_the_devices() -> None:
    proc = _run("""
        import torch, torch_pipeline as tp, torch_pipeline.sim as sim
        sim.enable(2)
        p = tp.Pipeline()
        assert p.stream(1).device_index == 1 and p.stream("sim:1").device_index == 1
        for bad in (2, 257, -1, 10**30, "sim:2", "sim:257", "sim:1023", "sim:100000000000"):
            for call in (p.stream, tp.comm_stream):
                try:
                    s = call(bad)
                except ValueError as e:
                    assert "sees 2 'sim' device(s) (indices 0..1)" in str(e), str(e)
                else:
                    raise AssertionError(f"{call.__name__}({bad!r}) returned {s}")
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# ---- examples/async_logging.py --help says the defaults it uses --------------------------------
def test_async_logging_help_states_the_defaults_it_uses() -> None:
    proc = _run(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import async_logging as ex
        args = ex.parse_args(["--device", "cpu"])
        print(args.steps, args.width, args.batch)
        ex.parse_args(["--help"])
    """)
    steps, width, batch = proc.stdout.splitlines()[0].split()
    help_text = " ".join(proc.stdout.split())
    assert f"(default: {steps} on CPU," in help_text
    assert f"(default: {width} on CPU," in help_text
    assert f"(default: {batch} on CPU," in help_text


# ---- python -m torch_pipeline ------------------------------------------------------------------
def _diagnostics(**env: str) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINE_")}
    child_env.update(env)
    return subprocess.run([sys.executable, "-m", "torch_pipeline"], capture_output=True,
                          text=True, timeout=120, env=child_env, cwd=CHILD_CWD)


def _fields(stdout: str) -> Dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        name, sep, value = line.partition(": ")
        if sep:
            out[name.rstrip(":").strip()] = value.strip()
    return out


def test_diagnostics_prints_versions_build_devices_modes_and_environment() -> None:
    import torch

    proc = _diagnostics(TORCH_PIPELINE_MAX_WORKER_THREADS="6", TORCH_PIPELINE_TYPO="1")
    assert proc.returncode == 0, proc.stderr
    f = _fields(proc.stdout)
    assert f["torch_pipeline"].startswith(tp.__version__)
    assert f["torch"].startswith(torch.__version__)
    assert f["python"] == sys.version.split()[0]
    assert f["built with CUDA"] in ("True", "False")
    assert torch.__version__.startswith(f["built against torch"])
    assert f["compiler"].split()[0] in ("gcc", "clang")
    assert f["accelerator"]
    assert f["cuda available"] == str(torch.cuda.is_available())
    assert f["max worker threads"] == "6"
    assert f["allocator safety (keep-alive mode)"] == "keep_alive"
    assert f["tracking"].startswith("enabled, idle")
    assert f["$TORCH_PIPELINE_MAX_WORKER_THREADS"] == "6"
    assert f["$TORCH_PIPELINE_EXIT_TIMEOUT"] == "(unset)"
    assert "not a torch_pipeline setting" in f["$TORCH_PIPELINE_TYPO"]
    assert "bug reports" in proc.stdout


def test_diagnostics_reports_a_bad_setting_and_exits_1() -> None:
    proc = _diagnostics(TORCH_PIPELINE_ALLOCATOR_SAFETY="fast")
    assert proc.returncode == 1
    f = _fields(proc.stdout)
    assert "ValueError" in f["allocator safety (keep-alive mode)"]
    assert "TORCH_PIPELINE_ALLOCATOR_SAFETY" in f["allocator safety (keep-alive mode)"]


# ---- scripts/demo.sh and scripts/test.sh: what they install, with a stand-in venv -------------
def _run_script(tmp_path: Path, script: str, **env: str) -> List[str]:
    """Runs scripts/<script> with VENV pointing at a stand-in python that only logs its
    arguments (one line per call); returns those lines."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    log = tmp_path / "calls.log"
    stub = venv_bin / "python"
    stub.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {log}
        # "import torch" fails, as in a fresh venv, so that the scripts install it
        [ "$1" = "-c" ] && [[ "$2" == "import torch"* ]] && [[ "$2" != *torch_pipeline* ]] && exit 1
        exit 0
        """))
    stub.chmod(0o755)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    child_env.update(env, VENV=str(tmp_path / "venv"))
    # A session of its own, so that a script that goes wrong (builds the C++ tests after all) is
    # stopped with everything it started.
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=child_env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"scripts/{script} did not finish in 60 s with a stand-in python")
    assert proc.returncode == 0, out
    assert "== C++ core" not in out, "PYTHON_ONLY=1 must skip the GoogleTest step"
    return log.read_text().splitlines()


def _pip_installs(calls: List[str]) -> List[str]:
    return [c for c in calls if c.startswith("-m pip install")]


def test_demo_script_installs_numpy_and_takes_a_torch_index(tmp_path: Path) -> None:
    calls = _run_script(tmp_path, "demo.sh",
                        TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    installs = _pip_installs(calls)
    assert any("numpy" in c.split() for c in installs), installs  # no "Failed to initialize NumPy"
    torch_line = next(c for c in installs if "torch==" in c)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert any(c.startswith("examples/async_logging.py") for c in calls)


def test_test_script_python_only_skips_the_cpp_step(tmp_path: Path) -> None:
    calls = _run_script(tmp_path, "test.sh", PYTHON_ONLY="1")
    installs = _pip_installs(calls)
    assert any("ninja" in c.split() and "numpy" in c.split() for c in installs), installs
    torch_line = next(c for c in installs if "torch==" in c)
    assert "--index-url" not in torch_line  # pip's configured indexes unless TORCH_INDEX_URL
    assert any(c.startswith("-m pytest tests/python") for c in calls)


def test_readme_install_line_installs_ninja_and_shows_the_build_choice() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):readme.index("## The two commands")]
    assert "pip install ninja" in install
    assert "pip install -v --no-build-isolation ." in install
    assert "python -m torch_pipeline" in install
