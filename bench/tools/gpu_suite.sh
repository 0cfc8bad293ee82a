#!/usr/bin/env bash
# The whole `pytest -m gpu` on a CUDA machine, in two parts that each fit one 600 s device call:
#   bash bench/tools/gpu_suite.sh kernels [pytest args ...]  # every GPU test file but tests/test_model_gpu.py
#   bash bench/tools/gpu_suite.sh model [pytest args ...]    # tests/test_model_gpu.py over $GEMMA4_FIXTURE_GGUFS
# Verbose (-v), so a call cut by its time limit still names every test that passed (pytest-xdist's
# -q dots do not); the whole log goes to ${OUT:-.}/gpu-suite-<part>.txt, its PASSED / FAILED /
# ERROR lines' counts, the failures and pytest's summary to stdout. PYTHON: the interpreter
# (default python3); WORKERS: pytest-xdist workers for the kernels part (default 14, 0 for none).
part=${1:-}
shift $(( $# > 0 ? 1 : 0 ))
case "$part" in
  kernels) args=(tests/ --deselect tests/test_model_gpu.py)
           [ "${WORKERS:-14}" != 0 ] && args+=(-n "${WORKERS:-14}");;
  model) if [ -z "${GEMMA4_FIXTURE_GGUFS:-}" ]; then
           echo "model: set GEMMA4_FIXTURE_GGUFS to the fixture GGUFs' directory (tests/fixtures.py)"; exit 2
         fi
         args=(tests/test_model_gpu.py);;
  *) echo "usage: gpu_suite.sh kernels|model [pytest args ...]"; exit 2;;
esac
cd "$(dirname "$0")/../.." || exit 2  # the repository root: the test paths are relative to it
log="${OUT:-.}/gpu-suite-$part.txt"
"${PYTHON:-python3}" -m pytest -m gpu -v -p no:cacheprovider "${args[@]}" "$@" > "$log" 2>&1
status=$?
for word in PASSED FAILED ERROR SKIPPED; do
  printf '%s %s\n' "$word" "$(grep -c " $word" "$log")"
done
grep -E "^(FAILED|ERROR) " "$log" | head -40
tail -1 "$log"
exit $status
