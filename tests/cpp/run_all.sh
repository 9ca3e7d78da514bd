#!/usr/bin/env bash
# Builds the csrc/core tests and runs them three times: plain, ASan+UBSan, TSan.
# Usage: tests/cpp/run_all.sh   (from anywhere; build trees go to <repo>/build/cpp*)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
cd "${root}"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# TSan's runtime maps shadow memory at fixed addresses and can fail with "unexpected memory
# mapping" when the kernel randomises the address space too much. Running without ASLR avoids it.
tsan_launcher=""
if command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R true >/dev/null 2>&1; then
  tsan_launcher="setarch;$(uname -m);-R"
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

run_config() {
  local name="$1" dir="$2" sanitize="$3" launcher="$4"
  echo "=== ${name}: configure (${dir}) ==="
  # The build directory may hold a cache from an earlier run; pass every option explicitly.
  cmake -S tests/cpp -B "${dir}" "${generator[@]}" \
    -DSANITIZE="${sanitize}" -DTEST_LAUNCHER="${launcher}"
  echo "=== ${name}: build ==="
  cmake --build "${dir}" -j2
  echo "=== ${name}: test ==="
  ctest --test-dir "${dir}" --output-on-failure -j2
}

run_config plain build/cpp "" ""
run_config asan build/cpp-asan address ""
run_config tsan build/cpp-tsan thread "${tsan_launcher}"
echo "=== all three configurations passed ==="
