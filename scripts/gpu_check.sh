#!/usr/bin/env bash
# GPU check for torch_pipeline: build the extension against the torch already installed, run the
# GPU-marked tests, the benchmarks and the print(loss)-stall example, and write a summary.
#
#   OUT=/some/dir bash scripts/gpu_check.sh        # default OUT: ./gpu_check_out
#
# Needs: a CUDA GPU, torch with CUDA, a C++ compiler (and the CUDA toolkit for the exclusive-streams
# part of the build), setuptools; pytest for the test step. No internet: nothing is downloaded
# (pip runs with --no-build-isolation --no-deps).
#
# Files written to $OUT (13): summary.txt, env.log, build.log, pytest_gpu.log (every GPU-marked
# test: the automatic-synchronization twins, CUDA graph capture inside and across pipelines and
# reduce-overhead compiles (test_capture_gpu.py), NCCL on comm streams and the CUDA-sanitizer
# runs), bench_context.log, bench_submit.log, bench_tracking.log, bench_allocator.log, bench_lanes.log,
# bench_compile.log, async_logging.log, multi_branch.log, overlap_allreduce.log. Every step runs under `timeout`,
# within a total budget (GPU_CHECK_BUDGET_S, default 600 s); a failing step does not stop the
# script, its exit status is
# recorded in the summary, and the script exits 1 if any step failed (2 if the setup itself failed).
#
# Knobs: PYTHON (default python3, or python), GPU_CHECK_BUDGET_S, BENCH_FLAGS (default --check:
# a missed benchmark target fails the step; set BENCH_FLAGS= to only report), MAX_JOBS (build
# parallelism, default: number of CPUs).
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT_DIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT_DIR" || exit 2
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

if [ -z "${PYTHON:-}" ]; then
  if command -v python3 >/dev/null 2>&1; then PYTHON=python3; else PYTHON=python; fi
fi
BUDGET_S="${GPU_CHECK_BUDGET_S:-600}"
BENCH_FLAGS="${BENCH_FLAGS---check}"
export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # also works after an in-place build
export PYTHONUNBUFFERED=1
START_S=$(date +%s)
DEADLINE_S=$((START_S + BUDGET_S))
FAILED=0
STEP_LINES=()

say() { echo "$*" | tee -a "$SUMMARY"; }

# run_step NAME LOGFILE LIMIT_S CMD... : runs CMD under timeout (capped by what is left of the
# budget), output to $OUT_DIR/LOGFILE, prints its tail, records the outcome.
run_step() {
  local name="$1" log="$OUT_DIR/$2" limit="$3"
  shift 3
  local now left t0 rc status secs
  now=$(date +%s)
  left=$((DEADLINE_S - now))
  if [ "$left" -lt 15 ]; then
    STEP_LINES+=("$(printf '%-16s SKIPPED (total budget of %ss used up)' "$name" "$BUDGET_S")")
    FAILED=1
    echo "=== $name: SKIPPED, budget used up"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (timeout ${limit}s): $*"
  t0=$(date +%s)
  {
    echo "\$ $*"
    echo "# started $(date -u +%FT%TZ), timeout ${limit}s"
  } >"$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - t0))
  echo "# exit status $rc after ${secs}s" >>"$log"
  case "$rc" in
    0) status="ok" ;;
    124 | 137) status="TIMEOUT after ${limit}s (rc=$rc)" ;;
    *) status="FAILED (rc=$rc)" ;;
  esac
  [ "$rc" -ne 0 ] && FAILED=1
  STEP_LINES+=("$(printf '%-16s %-32s %4ss  %s' "$name" "$status" "$secs" "$(basename "$log")")")
  tail -n 25 "$log"
  echo "=== $name: $status (${secs}s)"
  return "$rc"
}

# ---- environment -------------------------------------------------------------------------------
ENV_LOG="$OUT_DIR/env.log"
{
  echo "# gpu_check.sh at $(date -u +%FT%TZ) on $(hostname), repo $REPO"
  echo "# git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no commit')" \
    "$(git -C "$REPO" status --porcelain 2>/dev/null | wc -l) changed/untracked paths"
  echo "\$ nvidia-smi"
  timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi failed (rc=$?)"
  echo "\$ $PYTHON (versions)"
  timeout 60 "$PYTHON" - <<'PY' 2>&1
import platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
except Exception as e:  # noqa: BLE001
    print("import torch FAILED:", repr(e))
    sys.exit(3)
print("torch", torch.__version__, "| torch.version.cuda", torch.version.cuda,
      "| cuda available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device 0:", torch.cuda.get_device_name(0), f"cc {p.major}.{p.minor}",
          f"{p.total_memory / 2**30:.0f} GiB")
from torch.utils import cpp_extension
print("CUDA_HOME", cpp_extension.CUDA_HOME)
for mod in ("setuptools", "ninja", "pytest", "pytest_timeout", "hypothesis", "numpy"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception:  # noqa: BLE001
        print(mod, "MISSING")
PY
  echo "python-check rc=$?"
  echo "nproc $(nproc 2>/dev/null), MAX_JOBS $MAX_JOBS"
  command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2
} >"$ENV_LOG" 2>&1
cat "$ENV_LOG"

say "torch_pipeline gpu_check  $(date -u +%FT%TZ)  host $(hostname)"
say "$(grep -E '^(python |torch |device 0:|CUDA_HOME)' "$ENV_LOG" | tr '\n' ';' | sed 's/;$//; s/;/ ; /g')"
if ! grep -q "cuda available True" "$ENV_LOG"; then
  say "WARNING: torch does not see a CUDA device; GPU tests will be skipped and the benchmarks run on CPU"
fi
say ""

# ---- build ------------------------------------------------------------------------------------
build() {
  echo "## pip install -v --no-build-isolation --no-deps -e .   (-v: shows what setup.py chose)"
  if "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . ; then
    :
  else
    echo "## pip editable install failed (rc=$?); falling back to setup.py build_ext --inplace"
    "$PYTHON" setup.py build_ext --inplace || return $?
  fi
  "$PYTHON" - <<'PY'
import torch, torch_pipeline as tp
print("torch_pipeline", tp.__version__, "from", tp.__file__)
print("CUDA exclusive streams built:", tp._C._cuda_exclusive_streams())
PY
}
export -f build
export PYTHON
run_step build build.log 300 bash -c build
BUILD_RC=$?
grep -E "torch_pipeline: building|CUDA exclusive streams built" "$OUT_DIR/build.log" | sed 's/^/  /' >>"$SUMMARY"

# ---- tests and programs -------------------------------------------------------------------------
if [ "$BUILD_RC" -eq 0 ]; then
  run_step pytest-gpu pytest_gpu.log 240 \
    "$PYTHON" -m pytest -m gpu tests/python -q -rfEs -p no:cacheprovider
  # shellcheck disable=SC2086
  run_step bench_context bench_context.log 60 "$PYTHON" bench/bench_context.py $BENCH_FLAGS
  # shellcheck disable=SC2086
  run_step bench_submit bench_submit.log 90 "$PYTHON" bench/bench_submit.py $BENCH_FLAGS
  # shellcheck disable=SC2086
  run_step bench_tracking bench_tracking.log 120 "$PYTHON" bench/bench_tracking.py --quick $BENCH_FLAGS
  run_step bench_allocator bench_allocator.log 60 "$PYTHON" bench/bench_allocator.py
  # shellcheck disable=SC2086
  run_step bench_lanes bench_lanes.log 90 "$PYTHON" bench/bench_lanes.py --device cuda --quick $BENCH_FLAGS
  # shellcheck disable=SC2086
  run_step bench_compile bench_compile.log 150 "$PYTHON" bench/bench_compile.py --device cuda --quick $BENCH_FLAGS
  run_step async_logging async_logging.log 90 "$PYTHON" examples/async_logging.py
  run_step multi_branch multi_branch.log 90 "$PYTHON" examples/multi_branch.py
  # NCCL needs a GPU per rank: as many ranks as GPUs (at least one).
  run_step overlap_allreduce overlap_allreduce.log 120 "$PYTHON" examples/overlap_allreduce.py \
    --device cuda --nproc "$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')"
else
  for s in pytest-gpu bench_context bench_submit bench_tracking bench_allocator bench_lanes bench_compile async_logging multi_branch overlap_allreduce; do
    STEP_LINES+=("$(printf '%-16s SKIPPED (build failed)' "$s")")
  done
  FAILED=1
fi

# ---- summary ------------------------------------------------------------------------------------
{
  echo ""
  echo "steps (name, outcome, seconds, log):"
  for line in "${STEP_LINES[@]}"; do echo "  $line"; done
  echo ""
  if [ -f "$OUT_DIR/pytest_gpu.log" ]; then
    echo "pytest:"
    grep -E "passed|failed|error|no tests ran|deselected|skipped" "$OUT_DIR/pytest_gpu.log" | tail -n 3 | sed 's/^/  /'
    grep -q "exit status 5 " "$OUT_DIR/pytest_gpu.log" && echo "  (exit status 5: no test was collected with -m gpu)"
    grep -E "^(FAILED|ERROR) " "$OUT_DIR/pytest_gpu.log" | head -n 20 | sed 's/^/  /'
  fi
  for b in bench_context bench_submit bench_tracking bench_lanes bench_compile; do
    [ -f "$OUT_DIR/$b.log" ] || continue
    echo "$b:"
    grep -E "^(PASS|FAIL)  |^ratio |^variant |^\[|^  peak |^SKIP  |^compiled regions|^(tp|with p|nullcontext|torch\.|executor|empty|idle|live|not imported|batch|no logging|loss|keep|save_on_cpu|default pipeline|two pipelines|outside|inside p)" "$OUT_DIR/$b.log" | sed 's/^/  /'
  done
  if [ -f "$OUT_DIR/async_logging.log" ]; then
    echo "async_logging:"
    grep -E "^async_logging:|^(naive|pipelined) |^speed-up|^check passed|^CHECK FAILED|Error" "$OUT_DIR/async_logging.log" | sed 's/^/  /'
  fi
  if [ -f "$OUT_DIR/bench_allocator.log" ]; then
    echo "bench_allocator:"
    grep -E "^cuda:|^sim:|peak allocated|^(join|deep queue):" "$OUT_DIR/bench_allocator.log" | sed 's/^/  /'
  fi
  if [ -f "$OUT_DIR/overlap_allreduce.log" ]; then
    echo "overlap_allreduce:"
    grep -E "ranks on|^no overlap|^overlap|^speed-up|^check passed|^CHECK FAILED|Error" "$OUT_DIR/overlap_allreduce.log" | sed 's/^/  /'
  fi
  if [ -f "$OUT_DIR/multi_branch.log" ]; then
    echo "multi_branch:"
    grep -E "^  (one stream|hand-written|pipelines)|^speed-up|^check passed|^CHECK FAILED|Error" "$OUT_DIR/multi_branch.log" | sed 's/^/  /'
  fi
  echo ""
  echo "total $(($(date +%s) - START_S))s; result: $([ "$FAILED" -eq 0 ] && echo 'ALL OK' || echo 'SOME STEPS FAILED')"
} >>"$SUMMARY"

echo ""
echo "================ summary ($SUMMARY)"
cat "$SUMMARY"
exit "$FAILED"
