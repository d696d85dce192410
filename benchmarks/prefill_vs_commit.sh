#!/usr/bin/env bash
# Prefill of this checkout against an older commit's, policy by policy, on stores each code
# converts itself from the same Hugging Face checkpoints (an old commit cannot read today's
# manifests), the two codes taking turns to go first, round by round. Run from the repo root, venv active:
#   bash benchmarks/prefill_vs_commit.sh COMMIT HF_DIR... [-- BENCH ARGS]
# e.g. bash benchmarks/prefill_vs_commit.sh 36960f5^ /tmp/pvb/hf_qwen3_next /tmp/pvb/hf_qwen3_moe
# (benchmarks/plan_vs_bench.py leaves those tiny checkpoints in /tmp/pvb). Writes
# $OUT/COMMIT/{old,new}-NAME-ROUND.json and prints each (store, policy, phase)'s medians. The
# old tree stays a git worktree for the next run: `git worktree remove $OUT/COMMIT/tree`.
set -euo pipefail
commit=$1; shift
hf=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do hf+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(-p 512 -g 8 --prefill-step-size 128 --arena-gb 0.0001
  --policies demand,static,lookahead --repeats 2)
ROUNDS=${ROUNDS:-3}; here=$PWD
rev=$(git rev-parse --short "$commit")
OUT=${OUT:-/tmp/prefill-vs-commit}/$rev  # the old tree and stores are this commit's
old=$OUT/tree
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.log  # figures of this run only
[ -d "$old" ] || git worktree add -q --detach "$old" "$rev"
(cd "$old" && python setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1) \
  || { echo "building $rev failed: $OUT/build.log"; exit 1; }
for h in "${hf[@]}"; do
  name=$(basename "$h")
  for code in old new; do
    dir=$here; [ $code = old ] && dir=$old
    [ -f "$OUT/$code-$name/manifest.json" ] || (cd "$dir" && python -m strata_mlx convert \
      --hf-path "$h" --mlx-path "$OUT/$code-$name" --calibration-tokens 64 >"$OUT/convert.log" \
      2>&1) || { echo "$code code could not convert $h: $OUT/convert.log"; exit 1; }
  done
done
for r in $(seq "$ROUNDS"); do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"  # drift falls on both alike
  for code in $order; do
    dir=$here; [ $code = old ] && dir=$old
    for h in "${hf[@]}"; do
      name=$(basename "$h")
      (cd "$dir" && python -m strata_mlx bench --model "$OUT/$code-$name" "${args[@]}" \
        --json "$OUT/$code-$name-$r.json" >"$OUT/$code-$name-$r.log" 2>&1) \
        || { echo "bench failed: $OUT/$code-$name-$r.log"; exit 1; }
    done
  done
done
python "$here/benchmarks/old_vs_new.py" "$OUT"/old-*-[0-9]*.json "$OUT"/new-*-[0-9]*.json
