"""Writes scripts/gpu_check.sh's summary.json and summary.txt from what its steps left in the logs
folder: steps.jsonl (one line per step), env.json, build.log, pytest_gpu.xml (JUnit),
bench_records.jsonl (bench/_harness.py's ``record`` lines) and each step's log. Standard library
only, so that it runs whatever else is missing.

    python scripts/gpu_summary.py LOGS_DIR OUT_DIR MODE START_EPOCH BUDGET_S
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional

# Lines of the examples (they print their speed-ups; bench/ scripts record theirs as JSON).
SPEEDUP = re.compile(r"^\s*speed-up(?: (?P<what>[^:]*))?:\s+(?P<ratio>[0-9.]+)x"
                     r"(?: \(target >= (?P<target>[0-9.]+)x\))?")
CHECK = re.compile(r"^(check passed|CHECK FAILED)")
EXAMPLES = ("async_logging", "multi_branch", "overlap_allreduce")
# Every step gpu_check.sh runs, in order (a step missing from the summary or not listed here is
# reported, and CI's dry run fails on either).
STEPS = ("env", "build", "pytest-gpu", "bench_context", "bench_submit", "bench_tracking",
         "bench_allocator", "bench_overlap", "bench_compile") + EXAMPLES


def _read_jsonl(path: str) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    out.append({"unparsed": line})
    return out


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def pytest_results(path: str) -> Optional[Dict[str, Any]]:
    """Counts and failing test ids from a JUnit XML file (None when there is none)."""
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable JUnit XML: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: List[str] = []
    skipped_reasons: Dict[str, int] = {}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0) or 0)
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
            sk = case.find("skipped")
            if sk is not None:
                reason = (sk.get("message") or "").strip()[:120]
                skipped_reasons[reason] = skipped_reasons.get(reason, 0) + 1
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed[:50], "skipped_reasons": skipped_reasons}


def example_results(log: str) -> Dict[str, Any]:
    ratios, targets, checks = [], [], []
    for line in log.splitlines():
        m = SPEEDUP.match(line)
        if m:
            what = (m.group("what") or "speed-up").strip()
            ratio = float(m.group("ratio").rstrip("."))
            if m.group("target"):
                limit = float(m.group("target"))
                targets.append({"label": f"speed-up {what}", "ratio": ratio,
                                "target": f">= {limit:g}", "passed": ratio >= limit})
            else:
                ratios.append({"label": f"speed-up {what}", "ratio": ratio})
        elif CHECK.match(line):
            checks.append(line.strip()[:300])
    return {"ratios": ratios, "targets": targets, "checks": checks}


def _rerun(failed: List[str], not_reached: List[str]) -> Optional[str]:
    """GPU_CHECK_STEPS for a second call: the build (a fresh machine has none), then what failed
    or was not reached (the script was stopped)."""
    again = [n for n in failed + not_reached if n in STEPS and n not in ("env", "build")]
    if not again and not failed:
        return None
    return "GPU_CHECK_STEPS=" + ",".join(["build"] + again)


def main(argv: List[str]) -> int:
    logs, out, mode, start, budget = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    steps = _read_jsonl(os.path.join(logs, "steps.jsonl"))
    env: Dict[str, Any] = {}
    try:
        env = json.loads(_read(os.path.join(logs, "env.json")) or "{}")
    except ValueError as e:
        env = {"error": f"unreadable env.json: {e}"}
    build_log = _read(os.path.join(logs, "build.log"))
    build_line = re.search(r"torch_pipeline: building .*", build_log)
    streams = re.search(r"CUDA exclusive streams built: (\w+)", build_log)
    build = {"line": build_line.group(0).strip() if build_line else None,
             "with_cuda": bool(build_line and "building with CUDA" in build_line.group(0)),
             "exclusive_streams": streams.group(1) == "True" if streams else None}

    benchmarks: Dict[str, Dict[str, Any]] = {}
    for r in _read_jsonl(os.path.join(logs, "bench_records.jsonl")):
        b = benchmarks.setdefault(r.pop("bench", "?"), {"ratios": [], "targets": [], "skipped": []})
        kind = r.pop("kind", "ratio")
        b[{"target": "targets", "skip": "skipped"}.get(kind, "ratios")].append(r)
    by_name = {s.get("name"): s for s in steps}
    for name in EXAMPLES:
        if name in by_name and os.path.exists(os.path.join(logs, f"{name}.log")):
            res = example_results(_read(os.path.join(logs, f"{name}.log")))
            if any(res.values()):
                benchmarks[name] = res
    for name, b in benchmarks.items():
        if name in by_name:
            b["status"] = by_name[name].get("status")

    # Skipped for want of a GPU, NCCL or pytest is reported, not failed; for want of time or of
    # a build it is failed (the step should have run).
    failed = [s["name"] for s in steps if not str(s.get("status", "")).startswith("ok") and (
        not str(s.get("status", "")).startswith("skipped")
        or str(s.get("status")).startswith(("skipped: budget", "skipped: build failed")))]
    missed = [f"{n}: {t.get('label')}" for n, b in benchmarks.items() for t in b["targets"]
              if t.get("passed") is False]
    device_skipped = [s["name"] for s in steps
                      if str(s.get("status", "")).startswith("skipped: no GPU")]
    if failed:
        result = "SOME STEPS FAILED"
    elif mode == "dry-run":
        result = "DRY RUN OK"
    elif device_skipped:
        result = "NO GPU: the device steps were skipped"
    else:
        result = "ALL OK"
    summary = {
        "schema": 1,
        "script": "scripts/gpu_check.sh",
        "mode": mode,
        "result": result,
        "failed_steps": failed,
        # What a second call should run (the build again: a fresh machine has none).
        "rerun": _rerun(failed, [n for n in STEPS if n not in by_name]),
        "missing_steps": [n for n in STEPS if n not in by_name],
        "unexpected_steps": [n for n in by_name if n not in STEPS],
        "missed_targets": missed,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "total_s": int(time.time()) - start,
        "budget_s": budget,
        "gpu": env.get("gpu"),
        "torch": env.get("torch"),
        "cuda": env.get("torch_cuda"),
        "python": env.get("python"),
        "environment": env,
        "build": build,
        "steps": steps,
        "pytest": pytest_results(os.path.join(logs, "pytest_gpu.xml")),
        "benchmarks": benchmarks,
        "logs": "logs.tar.gz",
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, sort_keys=False)
        f.write("\n")
    with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text(summary))
    return 0


def text(s: Dict[str, Any]) -> str:
    env = s["environment"]
    gpu = s["gpu"] or {}
    lines = [
        f"torch_pipeline gpu_check ({s['mode']}) {s['started_utc']}: {s['result']} "
        f"in {s['total_s']} s (budget {s['budget_s']} s)",
        f"python {s['python']}, torch {s['torch']}, CUDA {s['cuda']} (nvcc: "
        f"{env.get('nvcc_release') or 'none'}; driver {env.get('driver') or 'none'}), "
        f"GPU {gpu.get('name', 'none')} ({gpu.get('count', 0)} devices, NCCL {env.get('nccl')})",
        f"missing: {', '.join(env.get('missing', [])) or 'nothing'}",
        f"build: {s['build']['line']}; exclusive CUDA streams: {s['build']['exclusive_streams']}",
        f"rerun what failed or did not fit: {s['rerun']} bash scripts/gpu_check.sh" if s["rerun"]
        else "nothing to rerun",
        "",
        "steps:",
    ]
    for st in s["steps"]:
        note = f"  ({st['note']})" if st.get("note") else ""
        lines.append(f"  {st['name']:<18} {st['status']:<34} {st.get('seconds', 0):>4} s "
                     f"/ {st.get('limit_s', 0):>4} s{note}")
    p = s["pytest"]
    if p:
        lines += ["", f"pytest -m gpu: {p.get('passed', '?')} passed, "
                      f"{p.get('failures', '?')} failed, "
                      f"{p.get('errors', '?')} errors, {p.get('skipped', '?')} skipped"]
        lines += [f"  FAILED {t}" for t in p.get("failed", [])]
    for name, b in s["benchmarks"].items():
        lines += ["", f"{name}:"]
        for t in b.get("targets", []):
            ratio = f"{t['ratio']:.2f}x " if isinstance(t.get("ratio"), (int, float)) else ""
            what = f" ({t['numerator']} / {t['denominator']})" if t.get("numerator") else ""
            lines.append(f"  {'PASS' if t.get('passed') else 'FAIL'}  {t.get('label')}{what}: "
                         f"{ratio}(target {t.get('target')})")
        for r in b.get("ratios", []):
            label = r.get("label") or f"{r.get('numerator')} / {r.get('denominator')}"
            lines.append(f"  ratio {label} = {r.get('ratio', 0):.2f}x")
        lines += [f"  {c}" for c in b.get("checks", [])]
        lines += [f"  SKIP  {k.get('label')}: {k.get('reason')}" for k in b.get("skipped", [])]
    lines += ["", "every log: logs.tar.gz; everything above, machine-readable: summary.json", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
