"""Running a sim test module in a child process of its own.

Enabling the sim device renames PyTorch's PrivateUse1 backend for the rest of the process and makes
"sim" torch.accelerator's device, which other test files (that expect no accelerator on a CPU
machine) must not see. So a module that enables sim calls :func:`install_proxies` at its end: in
the parent process each of its tests is replaced by a proxy that reports the child's verdict for it
(the child runs the whole module once, on first use). With TORCH_PIPELINE_SIM_TEST_CHILD=1 the
tests run in-process (that is how the child runs them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import contextlib
import gc
from typing import Any, Callable, Dict, Iterator, MutableMapping, Tuple

import pytest

IN_CHILD = os.environ.get("TORCH_PIPELINE_SIM_TEST_CHILD") == "1"

_CHILD_MAIN = """
import json, os, sys
import pytest

class Collect:
    def __init__(self):
        self.results = {}

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::", 1)[1]
        if report.when != "call" and report.outcome == "passed":
            return
        outcome = report.outcome
        if hasattr(report, "wasxfail") and report.skipped:
            outcome, text = "xfailed", report.wasxfail  # an expected failure, with its reason
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            text = report.longrepr[2]
        else:
            text = report.longreprtext
        if name not in self.results or self.results[name][0] == "passed":
            self.results[name] = [outcome, text]

class Shard:
    # TORCH_PIPELINE_SIM_TEST_SHARD="i/n": this child runs every n-th test from the i-th.
    def pytest_collection_modifyitems(self, items):
        shard = os.environ.get("TORCH_PIPELINE_SIM_TEST_SHARD")
        if shard:
            i, n = (int(v) for v in shard.split("/"))
            items[:] = items[i::n]

collect = Collect()
rc = pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
                 plugins=[collect, Shard()])
if rc == 5:  # a shard with no tests
    rc = 0
with open(sys.argv[2], "w") as f:
    json.dump({"rc": int(rc), "results": collect.results}, f)
"""


def install_proxies(module_globals: MutableMapping[str, Any], module_file: str,
                    timeout_s: float = 280.0, shards: int = 1) -> None:
    """In the parent process, replaces every ``test_*`` function of the module with a proxy for
    its verdict in the child process. In the child (IN_CHILD), does nothing. With ``shards`` > 1
    the module's tests are split over that many child processes that run at the same time (for a
    long module on a machine with as many cores)."""
    if IN_CHILD:
        return
    cache: Dict[str, Any] = {}

    def child_results() -> Dict[str, Any]:
        if not cache:
            with tempfile.TemporaryDirectory() as tmp:
                runs = []
                for i in range(shards):
                    report = os.path.join(tmp, f"report{i}.json")
                    env = dict(os.environ, TORCH_PIPELINE_SIM_TEST_CHILD="1",
                               TORCH_PIPELINE_SIM_TEST_SHARD=f"{i}/{shards}")
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _CHILD_MAIN, os.path.abspath(module_file), report],
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    runs.append((proc, report))
                cache.update({"rc": 0, "results": {}, "output": ""})
                deadline = time.monotonic() + timeout_s
                for proc, report in runs:
                    try:
                        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        output, _ = proc.communicate()
                        output += f"\n(killed after {timeout_s} s)"
                    if os.path.exists(report):
                        with open(report) as f:
                            verdict = json.load(f)
                    else:
                        verdict = {"rc": proc.returncode, "results": {}}
                    cache["rc"] = cache["rc"] or verdict["rc"]
                    cache["results"].update(verdict["results"])
                    cache["output"] += output[-6000 // shards:]
                    sys.stdout.write("".join(line + "\n" for line in output.splitlines()
                                             if "[sim]" in line))
        return cache

    def proxy(name: str) -> Callable[[], None]:
        def test() -> None:
            child = child_results()
            mine = {k: v for k, v in child["results"].items() if k == name or k.startswith(name + "[")}
            if not mine:
                pytest.fail(f"the sim test process did not run {name} (exit code {child['rc']}):\n"
                            f"{child['output']}", pytrace=False)
            failed = {k: v[1] for k, v in mine.items() if v[0] == "failed"}
            if failed:
                pytest.fail("in the sim test process:\n" +
                            "\n".join(f"{k}:\n{v}" for k, v in failed.items()), pytrace=False)
            xfailed = {k: v[1] for k, v in mine.items() if v[0] == "xfailed"}
            if xfailed:  # (strict xfail: an unexpected pass is a failure, reported above)
                reasons = sorted(set(xfailed.values()))
                pytest.xfail(f"{', '.join(sorted(xfailed))}: {'; '.join(reasons)}")
            if all(v[0] == "skipped" for v in mine.values()):
                pytest.skip(next(iter(mine.values()))[1])

        test.__name__ = name
        test.__doc__ = f"{name}, run in the sim test process"
        return test

    for name in [n for n in list(module_globals) if n.startswith("test_")]:
        module_globals[name] = proxy(name)


# ---- fixtures shared by the modules that run on sim ------------------------------------------------
def sim_enabled_fixture(num_devices: int = 2) -> Any:
    """A module's autouse fixture that enables sim with ``num_devices`` for the module (in the
    child process; in the parent it does nothing): ``_sim_enabled = sim_enabled_fixture(2)``."""

    @pytest.fixture(scope="module", autouse=True)
    def _sim_enabled() -> Iterator[None]:
        if IN_CHILD:
            import torch_pipeline.sim as sim
            sim.enable(num_devices=num_devices)
        yield

    return _sim_enabled


def tracked_sim_fixtures(num_devices: int = 2) -> Tuple[Any, Any]:
    """The fixtures of a module that tests automatic synchronization on sim (bind both names in the
    module: ``_sim_enabled, _fresh_state = tracked_sim_fixtures(2)``): sim enabled with
    ``num_devices`` for the module; each test starts strict, tracked, on device 0, with the host
    synchronized with every sim device and no races recorded (and ends the same way). In the
    parent process they do nothing."""

    @pytest.fixture(autouse=True)
    def _fresh_state() -> Iterator[None]:
        if not IN_CHILD:
            yield
            return
        import torch
        import torch_pipeline.sim as sim
        from torch_pipeline import _C

        def reset() -> None:
            gc.collect()
            _C._set_tracking_enabled(True)
            torch.accelerator.set_device_index(0)
            for d in range(num_devices):
                sim.synchronize(d)
            sim.clear_races()
            sim.set_strict(True)

        reset()
        yield
        sim.set_strict(False)
        reset()

    return sim_enabled_fixture(num_devices), _fresh_state


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Tracking off (the test-only switch), races recorded instead of raised: the untracked twin
    of a program shows the races that automatic synchronization removes."""
    import torch_pipeline.sim as sim
    from torch_pipeline import _C

    _C._set_tracking_enabled(False)
    sim.set_strict(False)
    sim.clear_races()
    try:
        yield
    finally:
        _C._set_tracking_enabled(True)


def fake_process_group() -> None:
    """torch.distributed on sim tensors (child process): PyTorch's fake backend (collectives that
    touch no data and return completed works), world size 2, initialized once per process. Its
    c10d ops are observed like real ones."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("cpu:fake,sim:fake", store=FakeStore(), rank=0, world_size=2)
