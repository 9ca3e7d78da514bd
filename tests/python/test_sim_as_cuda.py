"""CUDA programs run unmodified on the sim device (``python -m torch_pipeline.sim run``,
``sim.as_cuda``, the pytest plugin): their stream bugs are reported with the Python lines of both
accesses, the tensor and the fix; their fixed versions, and the same programs on torch_pipeline
pipelines, are clean; the torch.cuda API they use behaves as on CUDA.

The programs are in ``cuda_programs/``; each marks the lines a report must name with
``# LINE:<tag>``. Every run is a child process (enabling sim is for the rest of a process).
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "cuda_programs"


def _run_now(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TORCH_PIPELINE_SIM_TEST_CHILD", None)
    env.pop("TORCH_PIPELINE_SIM_TEST_SHARD", None)
    return subprocess.run([sys.executable, "-m", "torch_pipeline.sim", "run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240, env=env)


# The runs of the parametrized tests, started together by the first run() (two at a time on two
# cores: each is a fresh Python process, so the module takes about half the time).
_PLANNED = [(tuple(mode + [program] + bug), PROGRAMS)
            for program in ("side_stream.py", "prefetcher.py", "early_d2h.py", "side_allreduce.py")
            for mode in ([], ["--async"]) for bug in ([], ["--bug"])]
_PLANNED += [(tuple(mode + ["prefetcher.py", "--tp", "--bug"]), PROGRAMS)
             for mode in ([], ["--async"])]
_PLANNED += [(("api_tour.py",), PROGRAMS), (("--strict", "side_stream.py", "--bug"), PROGRAMS),
             (("--no-stacks", "side_stream.py", "--bug"), PROGRAMS),
             (("-m", "cuda_programs.early_d2h", "--bug"), HERE),
             (("-m", "cuda_programs.early_d2h"), HERE),
             (("many_streams.py", "--bug"), PROGRAMS), (("many_streams.py",), PROGRAMS),
             (("--compare", "early_d2h.py", "--bug"), PROGRAMS),
             (("--compare", "early_d2h.py"), PROGRAMS), (("--compare", "gpipe_train.py"), PROGRAMS),
             (("--compare", "--no-stacks", "side_stream.py", "--bug"), PROGRAMS),
             (("--compare", "--no-stacks", "many_streams.py"), PROGRAMS)]
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_futures: Dict[tuple, "concurrent.futures.Future[subprocess.CompletedProcess]"] = {}


def run(args: Sequence[str], cwd: Path = PROGRAMS) -> subprocess.CompletedProcess:
    """``python -m torch_pipeline.sim run ARGS`` in ``cwd``: its exit status and output."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1))
        for key in _PLANNED:
            _futures[key] = _pool.submit(_run_now, *key)
    future = _futures.get((tuple(args), cwd))
    return future.result() if future is not None else _run_now(args, cwd)


def marks_in(code: str) -> Dict[str, int]:
    """{tag: line number} of the ``# LINE:<tag>`` markers of some code."""
    out = {}
    for number, text in enumerate(code.splitlines(), start=1):
        m = re.search(r"# LINE:(\w+)", text)
        if m:
            out[m.group(1)] = number
    return out


def lines_of(program: str) -> Dict[str, int]:
    """The markers of a program of cuda_programs/."""
    return marks_in((PROGRAMS / program).read_text())


def races_in(output: str) -> List[str]:
    """The report's entries, one string each."""
    return re.findall(r"^race \d+ of \d+.*?(?=^race \d+ of|^torch_pipeline\.sim: )", output,
                      flags=re.S | re.M)


def later_and_earlier(entry: str) -> tuple:
    """(later access's part, earlier access's part) of a report entry."""
    later, earlier = entry.split("is not ordered after", 1)
    return later, earlier


# program, the later access's line, the earlier access's lines (one of them), words of the fix
BUGS = {
    "side_stream.py": ("read", ("step", "input"), "wait_stream"),
    "prefetcher.py": ("copy", ("use",), "record_stream"),
    "early_d2h.py": ("read", ("write",), "synchronize"),
    "side_allreduce.py": ("reduce", ("backward",), "wait_stream"),
}


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
@pytest.mark.parametrize("program", sorted(BUGS))
def test_a_stream_bug_is_reported_with_the_lines_of_both_accesses(program: str, mode: List[str]):
    later_tag, earlier_tags, fix = BUGS[program]
    marks = lines_of(program)
    result = run([*mode, program, "--bug"])
    assert result.returncode == 1, result.stdout + result.stderr
    entries = races_in(result.stderr)
    assert entries, result.stderr
    for entry in entries:
        later, earlier = later_and_earlier(entry)
        assert f"{program}:{marks[later_tag]} in " in later, entry
        assert any(f"{program}:{marks[tag]} in " in earlier for tag in earlier_tags), entry
        assert "cuda:0" in entry and "sim:" not in entry, entry  # named as the program named it
        assert "fix: " in entry and fix in entry, entry
    # One entry per pair of code locations.
    pairs = [tuple(re.findall(rf"{re.escape(program)}:(\d+) in ", part)[0]
                   for part in later_and_earlier(e)) for e in entries]
    assert len(pairs) == len(set(pairs)), pairs


def test_the_33rd_stream_aliasing_a_live_one_is_reported_with_both_lines():
    """Note [Stream aliases]: the 33rd torch.cuda.Stream() of a device (CUDA's pool of 32 per
    priority, round robin) is the 1st again; while the 1st is alive, the run names both lines
    (as a warning at once and in the summary, once per pair of lines). 31 layers: no alias."""
    marks = lines_of("many_streams.py")
    result = run(["many_streams.py", "--bug"])
    assert result.returncode == 0, result.stdout + result.stderr  # serialized, not a race
    summary = re.findall(r"^stream alias \d+ of (\d+): (.*)$", result.stderr, flags=re.M)
    assert len(summary) == 1 and summary[0][0] == "1", result.stderr
    text = summary[0][1]
    assert f"many_streams.py:{marks['loss']} in main returned the same stream" in text, text
    assert f"the one made at many_streams.py:{marks['layers']} in " in text, text
    assert "33rd aliases the 1st" in text and "cuda:0" in text, text
    assert result.stderr.count("RuntimeWarning: torch.cuda.Stream()") == 1, result.stderr
    fixed = run(["many_streams.py"])
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "alias" not in fixed.stderr, fixed.stderr
    assert fixed.stderr.strip().endswith("torch_pipeline.sim: no races"), fixed.stderr


def test_compare_shows_the_outputs_a_missing_wait_made_wrong():
    """--compare runs asynchronously, then reruns the program synchronously: a line of output
    that differs (the host summed a buffer a non_blocking copy had not filled yet) is printed
    with the synchronous line, and the exit status is 1; the fixed program's output is equal."""
    result = run(["--compare", "early_d2h.py", "--bug"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "differ from a synchronous rerun's" in result.stderr, result.stderr
    shown = re.search(r"^line 1: (sum .*)\n  synchronous: sum 1047552\.0$", result.stderr,
                      flags=re.M)
    assert shown is not None, result.stderr
    assert result.stdout.strip() == shown.group(1)  # the program's own output, passed on
    assert shown.group(1) != "sum 1047552.0"
    fixed = run(["--compare", "early_d2h.py"])
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "the output equals a synchronous rerun's (1 line(s))" in fixed.stderr, fixed.stderr
    assert fixed.stdout.strip() == "sum 1047552.0"
    # Both runs draw the same random numbers (many_streams.py does not seed: its loss would
    # differ between any two processes).
    unseeded = run(["--compare", "--no-stacks", "many_streams.py"])
    assert unseeded.returncode == 0, unseeded.stderr
    assert "the output equals a synchronous rerun's (1 line(s))" in unseeded.stderr, unseeded.stderr
    # A race of the synchronous rerun is not a failure of it (the program's races are reported
    # by this run, whose exit status they make 1).
    racy = run(["--compare", "--no-stacks", "side_stream.py", "--bug"])
    assert racy.returncode == 1 and "race(s)" in racy.stderr, racy.stderr
    assert "rerun failed" not in racy.stderr, racy.stderr


def test_torchgpipe_trains_unmodified_on_sim_clean_and_equal_to_the_cpu():
    """A public project's CUDA path, run as it is: torchgpipe's GPipe over cuda:0/cuda:1 (its own
    copy streams, record_stream, wait_stream, checkpointing with the CUDA RNG state). It
    completes on sim with no race, asynchronous and synchronous runs print the same, and the
    losses and weights are those of the same training on the CPU, bit for bit."""
    pytest.importorskip("torchgpipe")  # (CI installs it: scripts/test.sh)
    result = run(["--compare", "gpipe_train.py"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch_pipeline.sim: no races" in result.stderr, result.stderr
    assert "the output equals a synchronous rerun's (4 line(s))" in result.stderr, result.stderr
    reference = subprocess.run([sys.executable, "gpipe_train.py", "--cpu"], cwd=PROGRAMS,
                               capture_output=True, text=True, timeout=240)
    assert reference.returncode == 0, reference.stderr
    assert result.stdout == reference.stdout and "step 2 loss" in result.stdout, (
        result.stdout, reference.stdout)


def test_a_parameter_is_named_with_its_module_and_shape():
    result = run(["side_stream.py", "--bug"])
    assert "tensor Float[16] = Linear.bias" in result.stderr, result.stderr
    assert "tensor Float[8, 16]" in result.stderr  # the input: no name
    assert "(seen 2 times)" in result.stderr  # weight and bias: one pair of code locations


def test_a_backward_access_names_the_forward_that_made_it():
    result = run(["prefetcher.py", "--bug"])
    assert "in the backward of AddmmBackward0 (made by the forward at these lines)" in result.stderr


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
@pytest.mark.parametrize("program", sorted(BUGS))
def test_the_fixed_program_is_clean(program: str, mode: List[str]):
    result = run([*mode, program])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip().endswith("torch_pipeline.sim: no races"), result.stderr


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_the_prefetcher_on_a_pipeline_needs_neither_wait_nor_record_stream(mode: List[str]):
    result = run([*mode, "prefetcher.py", "--tp", "--bug"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no races" in result.stderr
    # The same loss as the fixed hand-written version.
    fixed = run([*mode, "prefetcher.py"])
    assert result.stdout == fixed.stdout and result.stdout.startswith("loss ")


def test_the_torch_cuda_api_of_a_stream_program_works():
    result = run(["api_tour.py"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "api tour: ok" in result.stdout and "no races" in result.stderr


def test_strict_mode_raises_at_the_racing_op():
    result = run(["--strict", "side_stream.py", "--bug"])
    assert result.returncode == 1
    assert "torch_pipeline.sim.RaceError" in result.stderr
    assert "sum " not in result.stdout  # the program stopped at the race


def test_junit_has_a_failing_case_per_pair_of_locations(tmp_path: Path):
    path = tmp_path / "races.xml"
    result = run(["--junit", str(path), "side_stream.py", "--bug"])
    assert result.returncode == 1
    suite = ET.parse(path).getroot()
    cases = suite.findall("testcase")
    assert suite.get("failures") == "2" and len(cases) == 2
    marks = lines_of("side_stream.py")
    assert cases[0].get("name") == (f"race at side_stream.py:{marks['read']} after "
                                    f"side_stream.py:{marks['step']}")
    assert "Linear.bias" in cases[0].find("failure").text
    clean = tmp_path / "clean.xml"
    assert run(["--junit", str(clean), "side_stream.py"]).returncode == 0
    assert ET.parse(clean).getroot().get("failures") == "0"


def test_a_module_runs_with_its_arguments_and_its_exit_status_is_kept():
    result = run(["-m", "cuda_programs.early_d2h", "--bug"], cwd=HERE)
    assert result.returncode == 1 and "early_d2h.py" in result.stderr, result.stderr
    assert run(["-m", "cuda_programs.early_d2h"], cwd=HERE).returncode == 0
    missing = run(["no_such_script.py"])
    assert missing.returncode == 2 and "can't open file" in missing.stderr


def test_the_programs_own_exit_status_wins(tmp_path: Path):
    script = tmp_path / "exits.py"
    script.write_text("import sys, torch\nx = torch.ones(2, device='cuda')\nsys.exit(3)\n")
    assert run([str(script)], cwd=tmp_path).returncode == 3
    script.write_text("raise ValueError('boom')\n")
    failed = run([str(script)], cwd=tmp_path)
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr


def test_without_stacks_races_are_still_reported_by_op():
    result = run(["--no-stacks", "side_stream.py", "--bug"])
    assert result.returncode == 1
    assert "aten::addmm" in result.stderr and "side_stream.py:" not in result.stderr


def _python(code: str, cwd: Path = PROGRAMS) -> subprocess.CompletedProcess:
    """Runs ``code`` with READ and WRITE set to the line numbers of its ``# LINE:read`` and
    ``# LINE:write`` markers (set on its first line, so the numbers stay)."""
    code = textwrap.dedent(code).lstrip("\n")
    marks = marks_in(code)
    prefix = f"READ, WRITE = {marks.get('read')}, {marks.get('write')}; "
    return subprocess.run([sys.executable, "-c", prefix + code], cwd=cwd, capture_output=True,
                          text=True, timeout=240)


def test_stacks_are_off_by_default_and_as_cuda_restores_everything():
    result = _python("""
        import torch, torch_pipeline.sim as sim
        import torch.distributed as dist
        cuda_available = torch.cuda.is_available()
        collectives = (dist.init_process_group, dist.all_reduce, dist.is_nccl_available)
        sim.enable(2)
        assert not sim.report_stacks()
        x = torch.ones(4, device="sim:0")
        s = torch.Stream(device="sim:0")
        with s:
            y = x * 2
        assert sim.races() and sim.races()[0].later_stack == []  # not paid by default
        sim.clear_races()
        with sim.as_cuda(devices=2):
            assert sim.report_stacks() and torch.cuda.is_available()
            a = torch.ones(4, device="cuda")                # LINE:write
            b = torch.cuda.Stream()
            with torch.cuda.stream(b):
                c = a * 2                                   # LINE:read
        race, = sim.races()
        assert ("<string>", READ, "<module>") in race.later_stack, race.later_stack
        assert ("<string>", WRITE, "<module>") in race.earlier_stack, race.earlier_stack
        assert not sim.report_stacks() and torch.cuda.is_available() == cuda_available
        assert torch.ones(2).to("sim:1").device.type == "sim"   # the mapping is gone
        assert (dist.init_process_group, dist.all_reduce, dist.is_nccl_available) == collectives
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_the_pytest_plugin_fails_a_racing_test(tmp_path: Path):
    (tmp_path / "test_cuda_code.py").write_text(textwrap.dedent("""
        import torch

        def test_racy():
            x = torch.ones(4, device="cuda")
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                y = x * 2

        def test_fixed():
            x = torch.ones(4, device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                y = x * 2
            assert y.is_cuda
    """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "torch_pipeline.sim.pytest_plugin", "--sim-cuda",
         "-p", "no:cacheprovider", "-q", "test_cuda_code.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert "RaceFound" in result.stdout and "test_cuda_code.py:8 in test_racy" in result.stdout
    assert "test_cuda_code.py:5 in test_racy" in result.stdout
