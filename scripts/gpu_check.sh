#!/usr/bin/env bash
# GPU check for torch_pipeline, made to fit one device call: build the extension against the torch
# already installed, run the GPU-marked tests, the benchmarks and the examples, and write a summary.
#
#   OUT=/some/dir bash scripts/gpu_check.sh [--dry-run]     # default OUT: ./gpu_check_out
#
# Writes exactly three files to $OUT: summary.json (every step's status, every benchmark's ratios
# and targets, the GPU, torch and CUDA versions, what is missing), summary.txt (the same for
# people) and logs.tar.gz (every step's log, the JUnit XML, the benchmark records).
#
# Nothing is downloaded: the build is `pip install --no-build-isolation --no-deps -e .`. Every
# step runs under `timeout`, within a total budget (GPU_CHECK_BUDGET_S, default 450 s: with the
# build on 16 cores everything fits in 8 minutes, so a rerun fits in the same device session); a
# step that fails, or needs what is missing (pytest, NCCL, triton, ...), is reported and the
# others go on. Exit status: 0 when every step that ran passed (and, without --dry-run, there was
# a GPU), 1 otherwise (2: $OUT unusable). On the device machine the whole command is
# `OUT="$OUT" bash scripts/gpu_check.sh` (with a limit of 540 s or more for the call).
#
# Without a CUDA device, or with --dry-run, the steps that need one report "skipped: no GPU" (or
# "skipped: dry run"); instead their scripts are imported (`--help`) and the flags this script
# passes are checked against their help, the GPU tests are collected, and bench_context runs on
# the CPU, so that CI (.ci/run) keeps this script working without a GPU.
#
# Knobs: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_STEPS (comma-separated steps to
# run, default all; e.g. GPU_CHECK_STEPS=build,pytest-gpu for a rerun), BENCH_FLAGS (default
# --check: a missed target fails the step; BENCH_FLAGS= only reports), MAX_JOBS (default nproc).
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done
OUT_DIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
rm -f "$OUT_DIR/summary.json" "$OUT_DIR/summary.txt" "$OUT_DIR/logs.tar.gz"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
LOGS="$WORK/logs"
mkdir -p "$LOGS" || exit 2

if [ -z "${PYTHON:-}" ]; then
  if command -v python3 >/dev/null 2>&1; then PYTHON=python3; else PYTHON=python; fi
fi
if [ "$DRY_RUN" = 1 ]; then
  MODE=dry-run
  BUDGET_S="${GPU_CHECK_BUDGET_S:-2400}"  # a CPU machine: the build alone takes minutes on 2 cores
else
  MODE=gpu
  BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
fi
STEPS="${GPU_CHECK_STEPS:-all}"
BENCH_FLAGS="${BENCH_FLAGS---check}"
export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # also works after an in-place build
export PYTHONUNBUFFERED=1
export TORCH_PIPELINE_BENCH_RECORDS="$LOGS/bench_records.jsonl"
START_S=$(date +%s)
DEADLINE_S=$((START_S + BUDGET_S))
RESERVE_S=10  # kept for the summary and the archive
FAILED=0
: >"$LOGS/steps.jsonl"

# ---- the summary, written however the script ends ------------------------------------------------
finish() {
  trap - EXIT INT TERM
  # Big logs are cut (head and tail) so that the archive stays far below what comes back (16 MiB).
  local f size
  for f in "$LOGS"/*.log; do
    [ -f "$f" ] || continue
    size=$(stat -c %s "$f" 2>/dev/null || echo 0)
    if [ "$size" -gt 3145728 ]; then
      { head -c 1048576 "$f"; printf '\n[... %s bytes cut ...]\n' "$size"; tail -c 2097152 "$f"; } >"$f.cut"
      mv "$f.cut" "$f"
    fi
  done
  if ! timeout 60 "$PYTHON" "$REPO/scripts/gpu_summary.py" "$LOGS" "$OUT_DIR" "$MODE" "$START_S" \
      "$BUDGET_S" >"$LOGS/summary_writer.log" 2>&1; then
    # No usable Python: still leave a summary that says so.
    printf '{"schema": 1, "mode": "%s", "result": "SUMMARY WRITER FAILED", "steps": []}\n' "$MODE" \
      >"$OUT_DIR/summary.json"
    { echo "gpu_check: the summary writer failed:"; tail -n 20 "$LOGS/summary_writer.log"; } \
      >"$OUT_DIR/summary.txt"
    FAILED=1
  fi
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs 2>/dev/null
  rm -rf "$WORK"
  echo ""
  echo "================ $OUT_DIR/summary.txt"
  cat "$OUT_DIR/summary.txt"
  exit "$FAILED"
}
CURRENT_STEP=""
trap 'FAILED=1; record interrupted "FAILED (interrupted by a signal)" 1 0 0 "" \
  "during ${CURRENT_STEP:-no step}" 0; finish' INT TERM
trap finish EXIT

# record NAME STATUS RC SECONDS LIMIT LOG NOTE DEVICE: one line of steps.jsonl.
record() {
  local note="${7//\\/\\\\}"
  note="${note//\"/\\\"}"
  printf '{"name": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "log": "%s", "note": "%s", "device": %s}\n' \
    "$1" "$2" "$3" "$4" "$5" "$6" "$note" "$8" >>"$LOGS/steps.jsonl"
  printf '=== %-18s %s (%ss)%s\n' "$1" "$2" "$4" "${7:+  $7}"
}

selected() {
  [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]
}

# run_step NAME LIMIT_S DEVICE CMD... : CMD under timeout (capped by what is left of the budget),
# its output in $LOGS/NAME.log; DEVICE=1: needs the GPU. Sets STEP_RC.
run_step() {
  local name="$1" limit="$2" device="$3"
  shift 3
  local log="$LOGS/$name.log" now left t0 rc status secs
  STEP_RC=0
  if ! selected "$name"; then
    record "$name" "skipped: not selected" 0 0 "$limit" "" "not in GPU_CHECK_STEPS" "$device"
    return 0
  fi
  now=$(date +%s)
  left=$((DEADLINE_S - now - RESERVE_S))
  if [ "$left" -lt 10 ]; then
    record "$name" "skipped: budget used up" 0 0 "$limit" "" "total budget ${BUDGET_S}s" "$device"
    FAILED=1
    STEP_RC=1
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  CURRENT_STEP=$name
  { echo "\$ $*"; echo "# started $(date -u +%FT%TZ), timeout ${limit}s"; } >"$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - t0))
  echo "# exit status $rc after ${secs}s" >>"$log"
  case "$rc" in
    0) status="ok" ;;
    124 | 137) status="TIMEOUT after ${limit}s" ;;
    *) status="FAILED (rc=$rc)" ;;
  esac
  [ "$rc" -ne 0 ] && FAILED=1
  STEP_RC=$rc
  record "$name" "$status" "$rc" "$secs" "$limit" "$name.log" "${STEP_NOTE:-}" "$device"
  STEP_NOTE=""
  CURRENT_STEP="after $name"
  [ "$rc" -ne 0 ] && tail -n 15 "$log"
  return 0
}

# skip_step NAME LIMIT_S DEVICE STATUS NOTE
skip_step() {
  record "$1" "$4" 0 0 "$2" "" "$5" "$3"
}

# dry_check NAME LIMIT_S SCRIPT ARGS...: what stands in for a device step without a GPU: the
# script must import and print its help, and every --flag this script passes must be in it.
dry_check() {
  local name="$1" limit="$2" script="$3"
  shift 3
  local log="$LOGS/$name.log" t0 rc=0 missing="" a secs
  t0=$(date +%s)
  { echo "\$ $PYTHON $script --help   (dry check of: $script $*)"; } >"$log"
  timeout -k 5 60 "$PYTHON" "$script" --help >>"$log" 2>&1 || rc=$?
  for a in "$@"; do
    case "$a" in
      --*) grep -q -- "${a%%=*}" "$log" || missing="$missing ${a%%=*}" ;;
    esac
  done
  secs=$(($(date +%s) - t0))
  if [ "$rc" -ne 0 ] || [ -n "$missing" ]; then
    FAILED=1
    record "$name" "FAILED (dry check)" "${rc:-1}" "$secs" "$limit" "$name.log" \
      "$NO_DEVICE; --help rc=$rc; flags not in its help:${missing:- none}" 1
  else
    record "$name" "$NO_DEVICE" 0 "$secs" "$limit" "$name.log" "imports, flags ok" 1
  fi
}

# device_step NAME LIMIT_S SCRIPT ARGS...: runs `$PYTHON SCRIPT ARGS` on the GPU, or dry-checks it.
device_step() {
  local name="$1" limit="$2" script="$3"
  shift 3
  if ! selected "$name"; then
    skip_step "$name" "$limit" 1 "skipped: not selected" "not in GPU_CHECK_STEPS"
  elif [ "$BUILD_OK" != 1 ]; then
    skip_step "$name" "$limit" 1 "skipped: build failed" ""
    FAILED=1
  elif [ -n "$NO_DEVICE" ]; then
    dry_check "$name" "$limit" "$script" "$@"
  else
    run_step "$name" "$limit" 1 "$PYTHON" "$script" "$@"
  fi
}

# ---- environment --------------------------------------------------------------------------------
env_check() {
  echo "# gpu_check.sh ($MODE) at $(date -u +%FT%TZ) on $(hostname), repo $REPO"
  echo "# git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git')," \
    "$(git -C "$REPO" status --porcelain 2>/dev/null | wc -l) changed/untracked paths"
  echo "# nproc $(nproc 2>/dev/null), MAX_JOBS $MAX_JOBS, budget ${BUDGET_S}s"
  echo "\$ nvidia-smi"
  timeout 20 nvidia-smi 2>&1 || echo "(nvidia-smi: rc=$?)"
  echo "\$ nvcc --version"
  timeout 20 nvcc --version 2>&1 || echo "(nvcc: rc=$?)"
  GPU_CHECK_ENV_JSON="$LOGS/env.json" timeout 90 "$PYTHON" - <<'PY'
import importlib, json, os, platform, shutil, subprocess, sys

env = {"python": platform.python_version(), "executable": sys.executable, "missing": []}
try:
    import torch
except Exception as e:  # noqa: BLE001
    env["torch"] = None
    env["missing"].append(f"torch ({e!r})")
else:
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    cuda = torch.cuda.is_available()
    env["cuda_available"] = cuda
    gpu = {"count": torch.cuda.device_count() if cuda else 0}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        gpu.update(name=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1))
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            env["driver"] = None
    env["gpu"] = gpu
    env["nccl"] = None
    try:
        import torch.distributed as dist
        if cuda and dist.is_available() and dist.is_nccl_available():
            v = torch.cuda.nccl.version()  # a tuple (an int on old versions)
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        env["nccl_error"] = repr(e)
    if env["nccl"] is None and cuda:
        env["missing"].append("NCCL")
    from torch.utils import cpp_extension
    env["cuda_home"] = cpp_extension.CUDA_HOME
    if env["torch_cuda"] and not cpp_extension.CUDA_HOME:
        env["missing"].append("CUDA toolkit (CUDA_HOME): the build leaves out the CUDA sources")
env["nvcc"] = shutil.which("nvcc")
if env["nvcc"]:
    try:
        out = subprocess.run([env["nvcc"], "--version"], capture_output=True, text=True, timeout=20)
        env["nvcc_release"] = [l for l in out.stdout.splitlines() if "release" in l][-1].strip()
    except Exception:  # noqa: BLE001
        env["nvcc_release"] = None
env["ninja"] = shutil.which("ninja")
if not env["ninja"]:
    env["missing"].append("ninja (the build compiles one file at a time)")
pkgs = {}
for mod in ("triton", "setuptools", "wheel", "pytest", "pytest_timeout", "hypothesis", "numpy",
            "expecttest"):
    try:
        pkgs[mod] = getattr(importlib.import_module(mod), "__version__", "?")
    except Exception:  # noqa: BLE001
        pkgs[mod] = None
        env["missing"].append(mod)
env["packages"] = pkgs
env["nproc"] = os.cpu_count()
print(json.dumps(env, indent=1))
with open(os.environ["GPU_CHECK_ENV_JSON"], "w") as f:
    json.dump(env, f)
PY
}
export -f env_check
export REPO LOGS MODE BUDGET_S PYTHON
run_step env 60 0 bash -c env_check
# The steps that need a device run only with one (and not in a dry run).
NO_DEVICE=""
if [ "$DRY_RUN" = 1 ]; then
  NO_DEVICE="skipped: dry run"
  grep -q '"cuda_available": true' "$LOGS/env.json" 2>/dev/null || NO_DEVICE="skipped: no GPU"
elif ! grep -q '"cuda_available": true' "$LOGS/env.json" 2>/dev/null; then
  NO_DEVICE="skipped: no GPU"
  FAILED=1  # a GPU check without a GPU checked nothing that needs one (--dry-run says it means it)
fi
has() {  # has MODULE: the environment check found it
  "$PYTHON" -c "import json,sys; e=json.load(open('$LOGS/env.json')); sys.exit(0 if (e.get('packages') or {}).get('$1') else 1)" 2>/dev/null
}

# ---- build --------------------------------------------------------------------------------------
build() {
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    # --no-index, no version check: pip reaches for no network (there is none to reach).
    echo "## pip install -v --no-build-isolation --no-deps --no-index -e .   (MAX_JOBS=$MAX_JOBS)"
    "$PYTHON" -m pip install -v --no-build-isolation --no-deps --no-index \
      --disable-pip-version-check -e . || return $?
  else  # no pip: build in place (PYTHONPATH has the repository)
    echo "## no pip: setup.py build_ext --inplace   (MAX_JOBS=$MAX_JOBS)"
    "$PYTHON" setup.py build_ext --inplace || return $?
  fi
  "$PYTHON" - <<'PY'
import torch, torch_pipeline as tp
print("torch_pipeline", tp.__version__, "from", tp.__file__, "against torch", torch.__version__)
print("CUDA exclusive streams built:", tp._C._cuda_exclusive_streams())
PY
}
export -f build
BUILD_LIMIT=240
[ "$DRY_RUN" = 1 ] && BUILD_LIMIT=1800  # 2 cores
run_step build "$BUILD_LIMIT" 0 bash -c build
BUILD_OK=0
if [ "$STEP_RC" = 0 ]; then
  BUILD_OK=1
  if ! selected build; then  # a rerun on a machine that built already: it must import
    "$PYTHON" -c "import torch_pipeline" >/dev/null 2>&1 || BUILD_OK=0
  fi
fi

# ---- GPU tests ----------------------------------------------------------------------------------
if ! selected pytest-gpu; then
  skip_step pytest-gpu 180 1 "skipped: not selected" "not in GPU_CHECK_STEPS"
elif [ "$BUILD_OK" != 1 ]; then
  skip_step pytest-gpu 180 1 "skipped: build failed" ""
elif ! has pytest; then
  skip_step pytest-gpu 180 1 "skipped: pytest missing" "no pip install here"
elif [ -n "$NO_DEVICE" ]; then
  # Without a GPU: the GPU tests must still be collected (they would skip).
  t0=$(date +%s)
  CURRENT_STEP=pytest-gpu
  timeout -k 5 120 "$PYTHON" -m pytest -m gpu tests/python --collect-only -q -p no:cacheprovider \
    >"$LOGS/pytest-gpu.log" 2>&1
  rc=$?
  n=$(grep -Eo '^[0-9]+(/[0-9]+)? tests? (collected|selected)' "$LOGS/pytest-gpu.log" | head -n 1)
  if [ "$rc" -eq 0 ] && [ -n "$n" ]; then
    record pytest-gpu "$NO_DEVICE" 0 $(($(date +%s) - t0)) 180 pytest-gpu.log "$n" 1
  else
    FAILED=1
    record pytest-gpu "FAILED (dry check)" "$rc" $(($(date +%s) - t0)) 180 pytest-gpu.log \
      "$NO_DEVICE; collecting the GPU tests failed (rc=$rc)" 1
  fi
else
  # --timeout: a hung test fails alone instead of using up the step (needs pytest-timeout); a test
  # module that cannot be imported here (hypothesis missing, ...) does not stop the others.
  PYTEST_TIMEOUT=()
  has pytest_timeout && PYTEST_TIMEOUT=(--timeout 100)
  run_step pytest-gpu 180 1 "$PYTHON" -m pytest -m gpu tests/python -q -rfEs -p no:cacheprovider \
    --continue-on-collection-errors ${PYTEST_TIMEOUT[@]+"${PYTEST_TIMEOUT[@]}"} \
    --junitxml="$LOGS/pytest_gpu.xml"
fi

# ---- benchmarks and examples (quick forms) -----------------------------------------------------
# shellcheck disable=SC2086
if [ -n "$NO_DEVICE" ] && [ "$BUILD_OK" = 1 ] && selected bench_context; then
  # bench_context runs on the CPU too: the dry run feeds its records to the summary.
  STEP_NOTE="on the CPU ($NO_DEVICE)"
  run_step bench_context 120 0 "$PYTHON" bench/bench_context.py --quick
else
  device_step bench_context 30 bench/bench_context.py --quick $BENCH_FLAGS
fi
# shellcheck disable=SC2086
device_step bench_submit 30 bench/bench_submit.py --quick $BENCH_FLAGS
# shellcheck disable=SC2086
device_step bench_tracking 45 bench/bench_tracking.py --quick --only cuda $BENCH_FLAGS
device_step bench_allocator 45 bench/bench_allocator.py --device cuda --depths 64 --steps 10
# shellcheck disable=SC2086
device_step bench_overlap 40 bench/bench_overlap.py --device cuda --quick $BENCH_FLAGS
if [ -z "$NO_DEVICE" ] && [ "$BUILD_OK" = 1 ] && ! has triton && selected bench_compile; then
  STEP_NOTE="triton missing: the [compile] rows report SKIP"
fi
# shellcheck disable=SC2086
device_step bench_compile 75 bench/bench_compile.py --device cuda --quick $BENCH_FLAGS
device_step async_logging 30 examples/async_logging.py --device cuda --steps 300
device_step multi_branch 30 examples/multi_branch.py --device cuda --rounds 3
if [ -z "$NO_DEVICE" ] && ! grep -q '"nccl": "' "$LOGS/env.json" 2>/dev/null; then
  skip_step overlap_allreduce 45 1 "skipped: no NCCL" "torch.distributed has no NCCL here"
else
  # NCCL needs a GPU per rank: as many ranks as GPUs (at least one).
  NPROC=$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)
  device_step overlap_allreduce 45 examples/overlap_allreduce.py --device cuda --nproc "$NPROC"
fi
# finish (the EXIT trap) writes the summary and the archive.
