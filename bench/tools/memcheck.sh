#!/usr/bin/env bash
# compute-sanitizer memcheck over the kernel-level GPU tests, on a CUDA machine with MLX's CUDA wheel.
#   bash bench/tools/memcheck.sh [seconds per test file, default 240] [test files or node ids ...] > memcheck.txt
# (PYTHON: the interpreter, default python3; TOOLS: the compute-sanitizer tools to run in turn over
# each file, default memcheck, e.g. "memcheck racecheck synccheck" for a kernel with barriers or
# tickets; PYTEST_K: a pytest -k expression, e.g. TOOLS="memcheck racecheck synccheck"
# PYTEST_K=mma8 bash bench/tools/memcheck.sh 150 tests/test_registry_cases_gpu.py for one kernel's
# registry cases, seconds each under the tools)
# First a planted out-of-bounds kernel, which memcheck must report; then each kernel test file in its
# own process (no pytest-xdist, so every kernel runs in the process the tool instruments).
# Limit: MLX's CUDA allocator rounds buffers up (powers of two below 16 KiB, whole 16 KiB pages
# above) and reuses cached ones, so an overrun smaller than that rounding lands in memory the
# process owns and goes unreported; a clean run rules out the larger ones. The poisoned-output
# tests and the Metal emulator's bounds checks cover the small ones.
CS=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
limit=${1:-240}
case "$limit" in
  ''|*[!0-9]*) echo "usage: memcheck.sh [seconds per test file] [test files or node ids, relative to the repository root ...]"; exit 2;;
esac
shift $(( $# > 0 ? 1 : 0 ))
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."  # the repository root: the test paths below are relative to it
planted=$("$CS" --tool memcheck --print-limit 3 "${PYTHON:-python3}" "$here/planted_oob.py" 2>&1)
echo "$planted" | grep -E "Invalid|ERROR SUMMARY" | head -2
if ! echo "$planted" | grep -q "Invalid __global__ write"; then
  echo "memcheck did not report the planted write: its results below would mean nothing"; exit 2
fi
status=0
# First every registered kernel text at its small registry shapes (seconds; every text, CUDA-only ones
# too), then the operator test files at their larger shapes (minutes each under memcheck).
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_registry_cases_gpu.py tests/test_norm_gpu.py tests/test_kernels_gpu.py
  tests/test_attention_gpu.py tests/test_rope_gpu.py tests/test_router_gpu.py tests/test_sampling_kernels_gpu.py)
kargs=()
[ -z "${PYTEST_K:-}" ] || kargs=(-k "$PYTEST_K")
for tool in ${TOOLS:-memcheck}; do
  for f in "${files[@]}"; do
    log=/tmp/$tool-$(basename "${f%%::*}" .py)${f#"${f%%::*}"}.txt  # a node id (file::test) keeps its test name
    log=${log//::/-}
    MLX_ENABLE_TF32=0 timeout "$limit" "$CS" --tool "$tool" --print-limit 20 --error-exitcode 9 \
      "${PYTHON:-python3}" -m pytest -m gpu -p no:cacheprovider -p no:benchmark -q "${kargs[@]}" "$f" > "$log" 2>&1
    rc=$?
    label=$f
    [ "$tool" = memcheck ] || label="$f ($tool)"
    echo "$label: rc $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1); $(tail -1 "$log")"
    grep -E "^========= (Invalid|Program hit|Race|Error|Barrier)" "$log" | sort | uniq -c | head -10
    [ "$rc" = 0 ] || status=1
  done
done
exit $status
