"""scripts/gpu_summary.py and gpu_check_verify.py, what gpu_check.sh leaves of a GPU run: the
summary carries every step, the benchmarks' records, the examples' speed-ups and targets, the
pytest counts, the versions, and what to rerun; the dry-run check rejects an incomplete one."""
from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_verify  # noqa: E402
import gpu_summary  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4"><testcase classname="tests.python.test_gpu" name="test_a"/>
<testcase classname="tests.python.test_gpu" name="test_b"><failure message="boom"/></testcase>
<testcase classname="tests.python.test_gpu" name="test_c"><skipped message="no NCCL"/></testcase>
<testcase classname="tests.python.test_gpu" name="test_d"/></testsuite></testsuites>"""


def _write_run(logs: Path, statuses: dict) -> None:
    logs.mkdir(parents=True)
    with open(logs / "steps.jsonl", "w") as f:
        for name in gpu_summary.STEPS:
            device = name not in ("env", "build")
            f.write(json.dumps({"name": name, "status": statuses.get(name, "ok"), "rc": 0,
                                "seconds": 1, "limit_s": 30, "log": f"{name}.log", "note": "",
                                "device": device}) + "\n")
    (logs / "env.json").write_text(json.dumps({
        "python": "3.12.1", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "missing": ["triton"],
        "gpu": {"count": 1, "name": "NVIDIA H200"}}))
    (logs / "build.log").write_text("torch_pipeline: building with CUDA (forced) against torch "
                                    "2.11.0+cu130\nCUDA exclusive streams built: True\n")
    (logs / "pytest_gpu.xml").write_text(JUNIT)
    (logs / "bench_records.jsonl").write_text(
        json.dumps({"bench": "bench_context", "kind": "target", "label": "enter+exit <= 4x",
                    "numerator": "with p", "denominator": "nullcontext()", "ratio": 5.0,
                    "target": "<= 4", "passed": False}) + "\n"
        + json.dumps({"bench": "bench_context", "kind": "ratio", "numerator": "with p",
                      "denominator": "torch.no_grad()", "ratio": 0.3}) + "\n")
    (logs / "multi_branch.log").write_text(
        "speed-up over one stream:       1.82x (target >= 1.7x)\n"
        "speed-up over hand-written code: 0.90x (target >= 0.95x)\n"
        "check passed: every variant computed the same output, bit for bit\n")
    (logs / "async_logging.log").write_text("speed-up pipelined / naive, end to end:    2.14x\n")


def test_the_summary_carries_steps_versions_benchmarks_and_tests(tmp_path: Path) -> None:
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    _write_run(logs, {"bench_context": "FAILED (rc=1)",
                      "overlap_allreduce": "skipped: budget used up"})
    assert gpu_summary.main([str(logs), str(out), "gpu", "0", "450"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert [st["name"] for st in s["steps"]] == list(gpu_summary.STEPS)
    assert s["missing_steps"] == [] and s["unexpected_steps"] == []
    assert (s["gpu"]["name"], s["torch"], s["cuda"]) == ("NVIDIA H200", "2.11.0+cu130", "13.0")
    assert s["build"] == {"line": "torch_pipeline: building with CUDA (forced) against torch "
                                  "2.11.0+cu130", "with_cuda": True, "exclusive_streams": True}
    assert s["result"] == "SOME STEPS FAILED" and s["failed_steps"] == ["bench_context",
                                                                         "overlap_allreduce"]
    assert s["rerun"] == "GPU_CHECK_STEPS=build,bench_context,overlap_allreduce"
    p = s["pytest"]
    assert (p["tests"], p["passed"], p["failures"], p["skipped"]) == (4, 2, 1, 1)
    assert p["failed"] == ["tests.python.test_gpu::test_b"]
    ctx = s["benchmarks"]["bench_context"]
    assert ctx["targets"][0]["ratio"] == 5.0 and ctx["targets"][0]["passed"] is False
    assert ctx["ratios"][0]["denominator"] == "torch.no_grad()" and ctx["status"] == "FAILED (rc=1)"
    mb = s["benchmarks"]["multi_branch"]
    assert [(t["ratio"], t["target"], t["passed"]) for t in mb["targets"]] == [
        (1.82, ">= 1.7", True), (0.9, ">= 0.95", False)]
    assert mb["checks"] == ["check passed: every variant computed the same output, bit for bit"]
    assert s["benchmarks"]["async_logging"]["ratios"][0]["ratio"] == 2.14
    assert sorted(s["missed_targets"]) == ["bench_context: enter+exit <= 4x",
                                           "multi_branch: speed-up over hand-written code"]
    text = (out / "summary.txt").read_text()
    assert "NVIDIA H200" in text and "FAIL  enter+exit <= 4x" in text and "FAILED tests" in text


def test_a_stopped_run_reruns_the_build_what_failed_and_what_it_did_not_reach() -> None:
    assert gpu_summary._rerun([], []) is None
    assert gpu_summary._rerun(["interrupted"], ["bench_overlap", "multi_branch"]) == (
        "GPU_CHECK_STEPS=build,bench_overlap,multi_branch")
    assert gpu_summary._rerun(["build"], []) == "GPU_CHECK_STEPS=build"


def _dry_out(tmp_path: Path, statuses: dict) -> Path:
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    device_skip = {n: "skipped: no GPU" for n in gpu_summary.STEPS if n not in ("env", "build",
                                                                              "bench_context")}
    _write_run(logs, {**device_skip, **statuses})
    (logs / "pytest_gpu.xml").unlink()
    for name in ("env.log", "pytest-gpu.log"):
        (logs / name).write_text("")
    (logs / "bench_records.jsonl").write_text(json.dumps(
        {"bench": "bench_context", "kind": "target", "label": "x", "ratio": 1.0, "target": "<= 4",
         "passed": True}) + "\n")
    gpu_summary.main([str(logs), str(out), "dry-run", "0", "2400"])
    with tarfile.open(out / "logs.tar.gz", "w:gz") as t:
        t.add(logs, arcname="logs")
    return out


def test_a_complete_dry_run_passes_the_ci_check(tmp_path: Path) -> None:
    out = _dry_out(tmp_path, {})
    assert gpu_check_verify.problems(str(out), "2.11.0+cu130") == []


def test_the_ci_check_rejects_a_failed_step_an_extra_file_or_another_torch(tmp_path: Path) -> None:
    out = _dry_out(tmp_path, {"bench_overlap": "FAILED (dry check)"})
    (out / "extra.log").write_text("")
    found = gpu_check_verify.problems(str(out), "2.14.1")
    assert any("bench_overlap" in f for f in found), found
    assert any("extra.log" in f for f in found), found
    assert any("expected '2.14.1'" in f for f in found), found
