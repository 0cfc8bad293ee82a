#!/usr/bin/env bash
# Alternated-process A/B of decode rates (GPU): separate processes move 5-15% between runs, so
# settings are compared by running them in turn, ROUNDS times, in one device call.
#   bash bench/tools/ab_decode.sh OUT_DIR ROUNDS MODELS CONTEXTS SETTING [SETTING ...]
#   SETTING = label[@tree]=[VAR=VALUE ...]   (tree: another checkout of the package, e.g. an old
#             commit's `git archive` carried along; default: this one)
# e.g. bash bench/tools/ab_decode.sh $OUT 2 E4B,26B-A4B 4096 default= \
#        no_nr=GEMMA4_MLX_KERNELS_OFF=norm_rope rp=GEMMA4_MLX_UNPROVEN_KERNELS=router_proj old@.oldtree=
# Each process: bench/decode.py --no-mlx-lm --breakdown-contexts "" --rounds 3, JSON to
# OUT_DIR/ab-<label>-<round>.json (AB_ARGS: more decode.py arguments, e.g. --quick on a CPU; PYTHON:
# the interpreter, default python3); the tokens/s rows are printed as they come. Two files per
# process: on the lent GPU machine (at most 8 files come back from $OUT) tar OUT_DIR afterwards.
set -u
out=$1 rounds=$2 models=$3 contexts=$4
shift 4
root="$(cd "$(dirname "$0")/../.." && pwd)"
py=${PYTHON:-python3}
case $py in /*) ;; */*) py="$PWD/$py" ;; esac  # a relative path survives the cd into a tree
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for setting in "$@"; do
    head=${setting%%=*} env_text=${setting#*=}
    label=${head%%@*} tree=$root
    [ "$head" != "$label" ] && tree="$(cd "$root/${head#*@}" && pwd)"
    (cd "$tree" && env PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$tree" $env_text timeout "${AB_TIMEOUT:-150}" \
      "$py" bench/decode.py --models "$models" --contexts "$contexts" --rounds 3 --no-mlx-lm \
      --breakdown-contexts "" ${AB_ARGS:-} --out "$out/ab-$label-$r.json" > "$out/ab-$label-$r.txt" 2>&1)
    echo "$label round $r (rc $?):"
    grep -E "^\| [0-9A-Za-z-]+ \| [0-9]+ \| [0-9.]+ " "$out/ab-$label-$r.txt" | grep -v "decode at" || tail -3 "$out/ab-$label-$r.txt"
  done
done
