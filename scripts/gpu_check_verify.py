"""CI's check of a scripts/gpu_check.sh dry run (no GPU): $OUT holds exactly summary.json,
summary.txt and logs.tar.gz; summary.json parses, lists every step, the steps that need a device
say "skipped: no GPU", the others passed, and it names the torch that ran.

    python scripts/gpu_check_verify.py OUT_DIR [EXPECTED_TORCH_VERSION]
"""
from __future__ import annotations

import json
import os
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_summary import STEPS  # noqa: E402


def problems(out: str, torch_version: str = "") -> list:
    found = []
    files = sorted(os.listdir(out))
    if files != ["logs.tar.gz", "summary.json", "summary.txt"]:
        found.append(f"$OUT holds {files}, expected exactly logs.tar.gz, summary.json, summary.txt")
    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        return found + [f"summary.json: {e}"]
    names = [st.get("name") for st in s.get("steps", [])]
    if names != list(STEPS):
        found.append(f"steps {names}, expected {list(STEPS)}")
    for st in s.get("steps", []):
        status = str(st.get("status"))
        if st.get("device") and st.get("name") != "bench_context":
            if status != "skipped: no GPU":
                found.append(f"device step {st['name']}: {status!r}, expected 'skipped: no GPU'")
        elif not status.startswith("ok"):
            found.append(f"step {st['name']}: {status!r} ({st.get('note', '')})")
    if s.get("result") != "DRY RUN OK":
        found.append(f"result {s.get('result')!r}")
    if torch_version and s.get("torch") != torch_version:
        found.append(f"torch {s.get('torch')!r}, expected {torch_version!r}")
    if not (s.get("build") or {}).get("line"):
        found.append("no build line (torch_pipeline: building ...) in the summary")
    if not (s.get("benchmarks") or {}).get("bench_context", {}).get("targets"):
        found.append("bench_context's targets did not reach the summary")
    try:
        with tarfile.open(os.path.join(out, "logs.tar.gz")) as t:
            logs = {os.path.basename(n) for n in t.getnames()}
        for need in ("env.log", "build.log", "steps.jsonl", "pytest-gpu.log"):
            if need not in logs:
                found.append(f"logs.tar.gz has no {need}")
    except (OSError, tarfile.TarError) as e:
        found.append(f"logs.tar.gz: {e}")
    return found


if __name__ == "__main__":
    found = problems(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    for line in found:
        print("gpu_check dry run:", line)
    print("gpu_check dry run: " + ("FAILED" if found else "summary complete"))
    sys.exit(1 if found else 0)
