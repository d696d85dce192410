#!/usr/bin/env bash
# The GPU machine's part of the measurements (see docs/benchmarks.md), in stages that fit one
# device call each. Run from the repo root there, after ../shared/device's MLX CUDA install:
#   export PYTHONPATH=/tmp/site; bash benchmarks/gpu_session.sh setup|synth|bench|kernels
# Logs land in $OUT (the device tool brings them back).
# A call carries at most 64 MiB (working tree + carried paths): MLX's CUDA half b is ~44 MB, so
# run from a snapshot without the GGUF fixtures (git archive HEAD | tar -x -C .snap
# --exclude=tests/data/gguf) and keep tests/data/gguf out of the tree for that call.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SYNTH=${SYNTH:-/root/strata-synth}
export PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$PWD"
plan_vs_bench() {  # PLAN.json BENCH.json: plan.compare's rows
  python3 -c "import json, sys; from strata_mlx import plan
for r in plan.compare(json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))): print(r)" "$@" 2>&1
}
build_both() {  # OLD_TREE: the native reader of the old tree and of this one
  (cd "$1" && python3 setup.py build_ext --inplace -q 2>&1 | tail -1)
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
}
old_vs_new_bench() {  # OLD_TREE STORE ROUND FIRST SECOND POLICIES: bench of each code on STORE
  # (NEWPOL: this code's policies, where they differ: variants the old code does not know)
  local tree=$1 store=$2 r=$3 pol=$6 code g=${G:-128}
  for code in $4 $5; do
    if [ "$code" = old ]; then
      (cd "$tree" && PYTHONPATH="${PYTHONPATH%%:*}:$tree" timeout 280 python3 -m strata_mlx bench \
         --model "$store" -p 2048 -g $g --arena-gb 6.5 --prefill-step-size 1024 --policies "$pol" \
         --json "$OUT/old-bench-$r.json" 2>&1 | tee "$OUT/old-bench-$r.log" | grep -v "^ *[0-9]")
    else
      timeout 280 python3 -m strata_mlx bench --model "$store" -p 2048 -g $g --arena-gb 6.5 \
         --prefill-step-size 1024 --policies "${NEWPOL:-$pol}" --json "$OUT/new-bench-$r.json" 2>&1 \
         | tee "$OUT/new-bench-$r.log" | grep -v "^ *[0-9]"
    fi
  done
}
case "${1:-}" in
setup)
  python3 setup.py build_ext --inplace -q 2>&1 | tail -3
  python3 -c "import mlx.core as mx; print(mx.default_device(), mx.__version__)"
  python3 -m pytest -q -p no:cacheprovider tests/stream/test_reader.py tests/runtime/test_streaming.py \
     tests/generation/test_generate.py tests/models/test_families.py -k "not quantized" 2>&1 | tail -15 | tee "$OUT/tests.log"
  ;;
synth)
  df -h / /root | tee "$OUT/df.log"
  /usr/bin/time -v python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b --mlx-path "$SYNTH" \
     --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -25 | tee "$OUT/synth.log"
  python3 -m strata_mlx probe-ssd "$SYNTH/experts.bin" --record-bytes 983040 --seconds 3 | tee "$OUT/probe.log"
  python3 benchmarks/read_under_compute.py "$SYNTH/experts.bin" --record-bytes 983040 --seconds 3 \
     --rounds 3 --workers 8 | tee "$OUT/read_under_compute.log"
  ;;
bench)
  python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --prefill-step-size 1024 \
     --io-workers 8 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  ;;
kernels)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_kernels.py 2>&1 | tail -30 | tee "$OUT/kernel_tests.log"
  python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log"
  ;;
full)  # one call: build, synthetic store, reads under compute, bench (about 7 minutes)
  python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  [ -d .sk-wheels ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .sk-wheels/*.whl
  /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3 | tee "$OUT/synth.log"
  timeout 60 python3 benchmarks/read_under_compute.py "$SYNTH/experts.bin" --record-bytes 983040 \
     --seconds 2 --rounds 2 --workers 8 2>&1 | tee "$OUT/read_under_compute.log"
  python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --prefill-step-size 1024 \
     --io-workers 8 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  ;;
decode)  # issue 17, call 1: store, GPU exactness tests, decode all resident beside mlx-lm
  python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3 | tee "$OUT/synth.log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_decode.py 2>&1 | tail -4 | tee "$OUT/tests.log"
  timeout 300 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --rounds 2 \
     --modes sync,layers:1,token:4,token:8,token:16,adaptive --json "$OUT/decode-resident.json" \
     2>&1 | tee "$OUT/decode-resident.log"
  ;;
decode-arena)  # issue 17, call 2: logits parity; 6.5 GB arena decode paths; prefill (new code)
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  timeout 150 python3 benchmarks/parity.py "$SYNTH" -p 128 --chunk 32 --json "$OUT/parity.json" \
     2>&1 | tee "$OUT/parity.log"
  timeout 250 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand,lookahead,lookahead:d2 --modes sync,adaptive --rounds 1 \
     --json "$OUT/decode-arena.json" 2>&1 | tee "$OUT/decode-arena.log"
  timeout 170 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 64 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies demand,lookahead --json "$OUT/bench-new.json" \
     2>&1 | tee "$OUT/bench-new.log"
  ;;
prefill-old)  # issue 17, call 3: the same bench on the code before this issue ($OLD)
  (cd "$OLD" && python3 setup.py build_ext --inplace -q 2>&1 | tail -2 && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" \
   timeout 170 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 64 --arena-gb 6.5 \
   --prefill-step-size 1024 --policies demand,lookahead --json "$OUT/bench-old.json") 2>&1 | tee "$OUT/bench-old.log"
  timeout 170 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 64 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies lookahead,demand --json "$OUT/bench-new2.json" \
     2>&1 | tee "$OUT/bench-new2.log"
  ;;
sched1)  # issue 10, call 1: store; prefill, loop against sync scheduling, chunk 1024
  python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3 | tee "$OUT/synth.log"
  python3 -m strata_mlx probe-ssd "$SYNTH/experts.bin" --record-bytes 983040 --seconds 2 | tee "$OUT/probe.log"
  timeout 330 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies lookahead:sync:d1,lookahead:loop:d2,static:sync \
     --json "$OUT/sched1.json" 2>&1 | tee "$OUT/sched1.log"
  ;;
sched2)  # issue 10, call 2: more depths, chunk 2048; decode at 6.5 GB, loop against sync
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  timeout 200 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies lookahead:loop:d3,lookahead:loop:d1,static:loop \
     --json "$OUT/sched2.json" 2>&1 | tee "$OUT/sched2.log"
  timeout 150 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 2048 --policies lookahead:sync:d1,lookahead:loop:d2 \
     --json "$OUT/sched2-2048.json" 2>&1 | tee "$OUT/sched2-2048.log"
  timeout 220 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 64 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,demand:loop,lookahead:sync:d1,lookahead:loop --modes adaptive --rounds 1 \
     --json "$OUT/decode-arena.json" 2>&1 | tee "$OUT/decode-arena.log"
  ;;
sched3)  # issue 10/17, call 3: resident decode, loop against sync, beside mlx-lm; old prefill
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  timeout 200 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --rounds 2 \
     --policies demand:sync,demand:loop --modes token:4 --json "$OUT/decode-resident.json" \
     2>&1 | tee "$OUT/decode-resident.log"
  (cd "$OLD" && python3 setup.py build_ext --inplace -q 2>&1 | tail -2 && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" \
   timeout 170 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 16 --arena-gb 6.5 \
   --prefill-step-size 1024 --policies demand,lookahead --json "$OUT/bench-old.json") 2>&1 | tee "$OUT/bench-old.log"
  timeout 170 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies demand,lookahead --json "$OUT/bench-new.json" \
     2>&1 | tee "$OUT/bench-new.log"
  ;;
r7a)  # session 4, call 1: store; kernels after the issue-15 refactor; logits against float32
  python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3 | tee "$OUT/synth.log"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_kernels.py 2>&1 | tail -8 \
     | tee "$OUT/kernel_tests.log"
  timeout 240 python3 benchmarks/parity.py "$SYNTH" -p 128 --chunk 32 --json "$OUT/parity.json" \
     2>&1 | tee "$OUT/parity.log"
  ;;
r7b)  # session 4, call 2: 6.5 GB decode, where the time goes, routing traces; bounce off
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  timeout 330 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,lookahead:loop --modes sync,adaptive --rounds 1 --trace "$OUT/trace" \
     --json "$OUT/decode-arena.json" 2>&1 | tee "$OUT/decode-arena.log"
  STRATA_MLX_BOUNCE=0 timeout 100 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 \
     --no-baseline --policies demand:sync --modes sync --rounds 1 \
     --json "$OUT/decode-arena-nobounce.json" 2>&1 | tee "$OUT/decode-arena-nobounce.log"
  ;;
r7c)  # session 4, call 3: store and GPU kernel tests side by side; 6.5 GB decode, split reads
  python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  (/usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3 > "$OUT/synth.log") &
  timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_kernels.py -x 2>&1 | tail -15 \
     > "$OUT/kernel_tests.log"
  wait
  cat "$OUT/synth.log" "$OUT/kernel_tests.log"
  python3 -m strata_mlx probe-ssd "$SYNTH/experts.bin" --record-bytes 983040 --seconds 1 \
     --workers 1,2,4,8,16 | tee "$OUT/probe.log"
  python3 -m strata_mlx probe-ssd "$SYNTH/experts.bin" --record-bytes 245760 --seconds 1 \
     --workers 4,8,16 | tee -a "$OUT/probe.log"
  timeout 330 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,demand:sync:s128,demand:sync:s128:io16,lookahead:loop:s128:io16 \
     --modes adaptive --rounds 1 --json "$OUT/decode-split.json" 2>&1 | tee "$OUT/decode-split.log"
  ;;
r7d)  # session 4, call 4: logits (experts in float32, the float32 oracle); prefill with split reads
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -2
  timeout 200 python3 benchmarks/parity.py "$SYNTH" -p 128 --chunk 32 --json "$OUT/parity.json" \
     2>&1 | tee "$OUT/parity.log"
  timeout 250 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies lookahead:loop,lookahead:loop:s128:io16 \
     --json "$OUT/bench-split.json" 2>&1 | tee "$OUT/bench-split.log"
  ;;
r8a)  # next session, call 1: the GPU kernel matrix alone (30 cases; > 220 s beside a conversion)
  python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_kernels.py 2>&1 | tail -25 \
     | tee "$OUT/kernel_tests.log"
  ;;
r8b)  # next session, call 2: store; decode and cold prefill at 6.5 GB, lru against lfu
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3 | tee "$OUT/synth.log"
  timeout 400 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,demand:sync:lfu,lookahead:loop,lookahead:loop:lfu --modes adaptive \
     --rounds 1 --json "$OUT/decode-lfu.json" 2>&1 | tee "$OUT/decode-lfu.log"
  ;;
r9a)  # session 5, call 2: the GPU kernel matrix, MXFP4 / GPT-OSS first (issue 11), with figures
  python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/runtime/test_kernels.py \
     -k "mxfp4 or gpt" 2>&1 | grep -E "eps|passed|failed|Error" | tail -20 | tee "$OUT/kernel_tests_mxfp4.log"
  timeout 330 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/runtime/test_kernels.py \
     -k "not (mxfp4 or gpt)" 2>&1 | grep -E "eps|passed|failed|Error" | tail -40 | tee "$OUT/kernel_tests.log"
  ;;
r9b)  # session 5, call 3: the first wave's store (--recipe before-issue-17): issue 17's "today"
  # at 6.5 GB against today's decoder; issue 10's prefill on the store its premise came from
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  OLDS=/root/strata-old
  /usr/bin/time -f "old-recipe store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --recipe before-issue-17 --mlx-path "$OLDS" --calibration-tokens 256 2>&1 | grep -v "experts:" \
     | tail -2 | tee "$OUT/synth-old.log"
  timeout 200 python3 benchmarks/decode.py "$OLDS" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,lookahead:loop --modes sync,adaptive --rounds 1 \
     --json "$OUT/decode-old.json" 2>&1 | tee "$OUT/decode-old.log"
  timeout 200 python3 -m strata_mlx bench --model "$OLDS" -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 1024 --io-workers 16 --policies lookahead:loop,lookahead:sync:d1,static:loop \
     --json "$OUT/bench-old.json" 2>&1 | tee "$OUT/bench-old.log"
  rm -rf "$OLDS"
  ;;
r9c)  # session 5, call 4: today's store; plan against bench (issue 14); verify on/off (issue 16)
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  [ -f "$SYNTH/manifest.json" ] || /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx \
     convert --synthetic qwen3-next-80b-a3b --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 \
     | grep -v "experts:" | tail -2 | tee "$OUT/synth.log"
  timeout 60 python3 benchmarks/verify_bandwidth.py "$SYNTH" --seconds 3 --rounds 3 --workers 8 \
     2>&1 | tee "$OUT/verify.log"
  timeout 150 python3 -m strata_mlx plan "$SYNTH" -p 2048 --prefill-step-size 1024 --arena-gb 6.5 \
     --json "$OUT/plan.json" 2>&1 | tee "$OUT/plan.log"
  timeout 150 python3 -m strata_mlx bench --model "$SYNTH" -p 2048 -g 32 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies lookahead --json "$OUT/bench-plan.json" 2>&1 | tee "$OUT/bench-plan.log"
  plan_vs_bench "$OUT/plan.json" "$OUT/bench-plan.json" | tee "$OUT/plan-vs-bench.log"
  ;;
r9d)  # session 5, call 5: decode at 6.5 GB, lru against lfu (the heap), same run
  timeout 400 python3 benchmarks/decode.py "$SYNTH" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,demand:sync:lfu,lookahead:loop:lfu --modes adaptive \
     --rounds 1 --json "$OUT/decode-lfu.json" 2>&1 | tee "$OUT/decode-lfu.log"
  ;;
r9e)  # session 5, last call: plan against bench after plan's Good-Turing fix, on a 12-layer store
  # of the same per-layer shape (the full store takes longer to write than the budget left)
  python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  S12=/root/strata-synth12
  /usr/bin/time -f "12-layer store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --set num_hidden_layers=12 --mlx-path "$S12" --calibration-tokens 256 2>&1 | grep -v "experts:" \
     | tail -2 | tee "$OUT/synth12.log"
  timeout 80 python3 -m strata_mlx plan "$S12" -p 2048 --prefill-step-size 1024 --arena-gb 1.625 \
     --json "$OUT/plan12.json" 2>&1 | tee "$OUT/plan12.log"
  timeout 100 python3 -m strata_mlx bench --model "$S12" -p 2048 -g 32 --arena-gb 1.625 \
     --prefill-step-size 1024 --policies lookahead --json "$OUT/bench12.json" 2>&1 | tee "$OUT/bench12.log"
  plan_vs_bench "$OUT/plan12.json" "$OUT/bench12.json" | tee "$OUT/plan-vs-bench12.log"
  ;;
r10a)  # next session: plan against bench with plan's decode changes (decode_hits, real recall,
  # read-ahead by mode) on the 12-layer store, -g as bench's
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  S12=/root/strata-synth12
  [ -f "$S12/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --set num_hidden_layers=12 --mlx-path "$S12" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -1
  for g in 32 128; do
    timeout 100 python3 -m strata_mlx plan "$S12" -p 2048 -g $g --prefill-step-size 1024 \
       --arena-gb 1.625 --json "$OUT/plan12-g$g.json" 2>&1 | tee "$OUT/plan12-g$g.log"
    timeout 150 python3 -m strata_mlx bench --model "$S12" -p 2048 -g $g --arena-gb 1.625 \
       --prefill-step-size 1024 --policies lookahead --json "$OUT/bench12-g$g.json" 2>&1 \
       | tee "$OUT/bench12-g$g.log"
    plan_vs_bench "$OUT/plan12-g$g.json" "$OUT/bench12-g$g.json" | tee "$OUT/plan-vs-bench12-g$g.log"
  done
  ;;
r10b)  # next session: the first wave's store at 6.5 GB, "layers" mode submitted in chunks
  # (decode_layers_chunk) against layers:1, token:4 and adaptive (issue 17's 2x, miss cost)
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  OLDS=/root/strata-old
  [ -f "$OLDS/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --recipe before-issue-17 --mlx-path "$OLDS" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -1
  timeout 300 python3 benchmarks/decode.py "$OLDS" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync --modes adaptive,layers:1,layers:2:2,layers:4:4,layers:7:4,token:4 \
     --rounds 1 --json "$OUT/decode-old-chunks.json" 2>&1 | tee "$OUT/decode-old-chunks.log"
  ;;
r10b2)  # right after r10b (the machine keeps the store only while warm): the same with lookahead
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  OLDS=/root/strata-old
  [ -f "$OLDS/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --recipe before-issue-17 --mlx-path "$OLDS" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -1
  timeout 200 python3 benchmarks/decode.py "$OLDS" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies lookahead:loop --modes adaptive,layers:4:4,layers:7:4 --rounds 1 \
     --json "$OUT/decode-old-chunks-la.json" 2>&1 | tee "$OUT/decode-old-chunks-la.log"
  rm -rf "$OLDS"  # room for r10c's store (64 GiB disk)
  ;;
r10c)  # next session: every expert resident, the same modes beside mlx-lm (issue 17's 1.15x)
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  [ -f /root/strata-synth/manifest.json ] || python3 -m strata_mlx convert --synthetic \
     qwen3-next-80b-a3b --mlx-path /root/strata-synth --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -1
  timeout 400 python3 benchmarks/decode.py /root/strata-synth -p 2048 -g 128 --rounds 2 \
     --modes token:4,layers:1,layers:4:4,layers:7:4,adaptive \
     --json "$OUT/decode-resident-chunks.json" 2>&1 | tee "$OUT/decode-resident-chunks.log"
  ;;
r10d)  # next session: issue 10's chunk 2048 (one cold chunk of the 2048-token prompt)
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  python3 -m strata_mlx probe-ssd /root/strata-synth/experts.bin --record-bytes 983040 --seconds 2 \
     | tee "$OUT/probe-2048.log"
  timeout 400 python3 -m strata_mlx bench --model /root/strata-synth -p 2048 -g 16 --arena-gb 6.5 \
     --prefill-step-size 2048 --io-workers 16 \
     --policies lookahead:loop,lookahead:sync:d1,static:loop \
     --json "$OUT/bench-2048.json" 2>&1 | tee "$OUT/bench-2048.log"
  ;;
r11a)  # seventh session: every expert resident, mlx-lm interleaved round by round (issue 17's
  # 1.15x with the machine's drift in both), decoder modes counted
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  [ -f /root/strata-synth/manifest.json ] || /usr/bin/time -f "synthetic store: %e s" python3 -m \
     strata_mlx convert --synthetic qwen3-next-80b-a3b --mlx-path /root/strata-synth \
     --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -2 | tee "$OUT/synth.log"
  timeout 330 python3 benchmarks/decode.py /root/strata-synth -p 2048 -g 128 --rounds 4 \
     --modes token:4,adaptive --interleave --json "$OUT/decode-interleaved.json" 2>&1 \
     | tee "$OUT/decode-interleaved.log"
  ;;
r11b)  # right after r11a: plan against bench on the full store with plan's measured union
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  timeout 170 python3 -m strata_mlx plan /root/strata-synth -p 2048 -g 32 --prefill-step-size 1024 \
     --arena-gb 6.5 --json "$OUT/plan.json" 2>&1 | tee "$OUT/plan.log"
  timeout 170 python3 -m strata_mlx bench --model /root/strata-synth -p 2048 -g 32 --arena-gb 6.5 \
     --prefill-step-size 1024 --policies lookahead --json "$OUT/bench-plan.json" 2>&1 \
     | tee "$OUT/bench-plan.log"
  plan_vs_bench "$OUT/plan.json" "$OUT/bench-plan.json" | tee "$OUT/plan-vs-bench.log"
  ;;
r11c)  # next session: the first wave's store at 6.5 GB; lookahead's decoder allowed "token"
  # mode (decode_token_while_predicting) against today's rule and demand, modes counted
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  OLDS=/root/strata-old
  [ -f "$OLDS/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --recipe before-issue-17 --mlx-path "$OLDS" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -1
  timeout 300 python3 benchmarks/decode.py "$OLDS" -p 2048 -g 128 --arena-gb 6.5 --no-baseline \
     --policies demand:sync,lookahead:loop --modes adaptive,adaptive+token --rounds 1 \
     --json "$OUT/decode-old-token-predicting.json" 2>&1 | tee "$OUT/decode-old-token-predicting.log"
  ;;
r11d)  # next session, call 2 (after setup a, with half b): today's full store at 6.5 GB, decode
  # lookahead predicting 1 layer ahead against 2 (read-bound decode: what its wasted reads
  # cost), beside demand, modes counted; then the store stays for r11b
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  [ -f /root/strata-synth/manifest.json ] || /usr/bin/time -f "synthetic store: %e s" python3 -m \
     strata_mlx convert --synthetic qwen3-next-80b-a3b --mlx-path /root/strata-synth \
     --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -2 | tee "$OUT/synth.log"
  timeout 330 python3 benchmarks/decode.py /root/strata-synth -p 2048 -g 64 --arena-gb 6.5 \
     --no-baseline --policies demand:sync,lookahead:loop,lookahead:loop:d1 --modes adaptive \
     --rounds 1 --json "$OUT/decode-depth.json" 2>&1 | tee "$OUT/decode-depth.log"
  ;;
r12a)  # eighth session, call 2: the code issue 17 was filed on ($OLD, a tree of 36960f5^ beside
  # this one) writes its own full store, then its bench and this code's take turns on it: issue
  # 17's "today" and its prefill non-regression measured in one run, on one store
  OLD=${OLD:-$PWD/old}; OLDS=/root/strata-old-code; build_both "$OLD"
  [ -f "$OLDS/manifest.json" ] || (cd "$OLD" && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" /usr/bin/time -f \
     "old code's synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$OLDS" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -2) | tee "$OUT/synth-old.log"
  old_vs_new_bench "$OLD" "$OLDS" 1 old new demand,lookahead
  ;;
r12b)  # right after r12a: the other order (drift falls on both codes alike)
  OLD=${OLD:-$PWD/old}; OLDS=/root/strata-old-code; build_both "$OLD"
  old_vs_new_bench "$OLD" "$OLDS" 2 new old lookahead,demand
  ;;
r12c)  # after r12b: the same store, this code's decoder modes: lookahead allowed "token" mode
  # (adaptive+token, which reads nothing ahead in that mode) against today's rule and demand
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  timeout 400 python3 benchmarks/decode.py /root/strata-old-code -p 2048 -g 128 --arena-gb 6.5 \
     --no-baseline --policies demand:sync,lookahead:loop --modes adaptive,adaptive+token \
     --rounds 1 --json "$OUT/decode-oldcode-store.json" 2>&1 | tee "$OUT/decode-oldcode-store.log"
  ;;
r12e)  # after r12c: prefill alone, the old code's lookahead against this code's under both
  # schedulers (the asyncio loop, the default, and the per-layer sync one), taking turns
  OLD=${OLD:-$PWD/old}; OLDS=/root/strata-old-code; build_both "$OLD"
  for r in 3 4; do
    timeout 150 python3 -m strata_mlx bench --model "$OLDS" -p 2048 -g 8 --arena-gb 6.5 \
       --prefill-step-size 1024 --policies lookahead,lookahead:sync:d1 --json "$OUT/new-bench-$r.json" \
       2>&1 | tee "$OUT/new-bench-$r.log" | grep -v "^ *[0-9]"
    (cd "$OLD" && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" timeout 100 python3 -m strata_mlx bench \
       --model "$OLDS" -p 2048 -g 8 --arena-gb 6.5 --prefill-step-size 1024 --policies lookahead \
       --json "$OUT/old-bench-$r.json" 2>&1 | tee "$OUT/old-bench-$r.log" | grep -v "^ *[0-9]")
  done
  ;;
r12f)  # a fresh machine's last minutes: prefill on the 12-layer store, the loop against the
  # sync scheduler at depth 1 and the default (loop, depth 2): which of the two r12e's gap is
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  S12=/root/strata-synth12
  [ -f "$S12/manifest.json" ] || /usr/bin/time -f "12-layer store: %e s" python3 -m strata_mlx \
     convert --synthetic qwen3-next-80b-a3b --set num_hidden_layers=12 --mlx-path "$S12" \
     --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -2
  timeout 170 python3 -m strata_mlx bench --model "$S12" -p 2048 -g 8 --arena-gb 1.625 \
     --prefill-step-size 1024 --policies lookahead:loop:d1,lookahead:sync:d1,lookahead --repeats 2 \
     --json "$OUT/sched12.json" 2>&1 | tee "$OUT/sched12.log" | grep -v "^ *[0-9]"
  ;;
r13)  # next session: `r13 FIRST LAST` (after r12a has written the old code's store): prefill
  # rounds FIRST..LAST of the two codes on it, -g 8, the order alternating round by round (odd:
  # old first), each code's policies rotating; five rounds take about 500 s, so split them
  OLD=${OLD:-$PWD/old}; OLDS=/root/strata-old-code; build_both "$OLD"
  for r in $(seq "${2:-1}" "${3:-2}"); do
    pol=demand,lookahead; [ $((r % 2)) = 0 ] && pol=lookahead,demand
    first=old second=new; [ $((r % 2)) = 0 ] && first=new second=old
    G=8 old_vs_new_bench "$OLD" "$OLDS" "p$r" $first $second $pol
  done
  python3 benchmarks/old_vs_new.py "$OUT"/old-bench-p*.json "$OUT"/new-bench-p*.json
  ;;
r13c)  # next session, after r13: decode on the old code's store, each policy under both
  # schedulers (r12c compared demand:sync with lookahead:loop: two changes at once), 3 rounds
  [ -f strata_mlx/_reader*.so ] || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  timeout 500 python3 benchmarks/decode.py /root/strata-old-code -p 2048 -g 128 --arena-gb 6.5 \
     --no-baseline --policies demand:loop,demand:sync,lookahead:loop,lookahead:sync --modes adaptive \
     --rounds 3 --json "$OUT/decode-oldcode-sched.json" 2>&1 | tee "$OUT/decode-oldcode-sched.log"
  ;;
r14)  # ninth session's plan, call 2: the old code's store (r12a's, 86-104 s), then what each
  # step of a record's way into managed memory costs (run 11 had this code's prefill 1.06-1.30x
  # the old code's, the same records read, read GB/s lower: the bounce copy and the checksum
  # sat on each worker's slot on the drive; the old reader had neither), with the device
  # reading the slots between reads as prefill's kernels do; then prefill round 1 (r14b)
  OLD=${OLD:-$PWD/old}; OLDS=/root/strata-old-code; build_both "$OLD"
  [ -f "$OLDS/manifest.json" ] || (cd "$OLD" && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" /usr/bin/time -f \
     "old code's synthetic store: %e s" python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$OLDS" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -2) | tee "$OUT/synth-old.log"
  cat /sys/kernel/mm/transparent_hugepage/enabled | tee "$OUT/thp.log"  # the bounce buffers' huge pages
  timeout 150 python3 benchmarks/read_path.py "$OLDS" --touch --seconds 3 --rounds 3 \
     --variants direct,bounce,bounce+verify,bounce+verify+overlap,bounce+overlap 2>&1 | tee "$OUT/read-path.log"
  bash "$0" r14b 1 1
  ;;
r14b)  # `r14b FIRST LAST`: prefill rounds as r13's, this code also with the overlap off (:ov0)
  OLD=${OLD:-$PWD/old}; OLDS=/root/strata-old-code; build_both "$OLD"
  for r in $(seq "${2:-1}" "${3:-2}"); do
    pol=demand,lookahead np=demand,demand:ov0,lookahead,lookahead:ov0
    [ $((r % 2)) = 0 ] && pol=lookahead,demand np=lookahead:ov0,lookahead,demand:ov0,demand
    first=old second=new; [ $((r % 2)) = 0 ] && first=new second=old
    G=8 NEWPOL=$np old_vs_new_bench "$OLD" "$OLDS" "q$r" $first $second $pol
  done
  python3 benchmarks/old_vs_new.py "$OUT"/old-bench-q*.json "$OUT"/new-bench-q*.json
  ;;
r12d)  # last: the old store removed; plan against bench on today's 12-layer store (issue 14)
  rm -rf /root/strata-old-code
  bash "$0" r10a
  ;;
kcall)  # decode's expert-kernel call: each kernel's own header against all of formats.h (host
  # time a call, benchmarks/kernel_call.py, on a one-layer store of the 80B's expert shape), then
  # the CUDA kernels against the reference (under 5 minutes in all)
  [ -f /tmp/q3n-1/manifest.json ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path /tmp/q3n-1 --calibration-tokens 0 --set num_hidden_layers=1 --set num_experts=16 \
     --set vocab_size=256 2>&1 | tail -1
  timeout 120 python3 benchmarks/kernel_call.py /tmp/q3n-1 2>&1 | tee "$OUT/kernel_call.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_kernels.py 2>&1 \
     | tail -15 | tee "$OUT/kernel_tests.log"
  ;;
serve|resume)  # issue 34 (carry .whl/serve: bash benchmarks/serve_wheels.sh here first): the
  # server's stack unzipped into /tmp/site; `serve`: the batching table through HTTP (about 4
  # minutes once the store exists); `resume`: a 16K-token conversation's first token resumed
  # from --prompt-cache-dir after a restart, against a cold prefill (about 5 minutes)
  python3 -c "import zipfile,glob; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('.whl/serve/*.whl')]"
  python3 -c "import fastapi, uvicorn, openai; print('fastapi', fastapi.__version__, 'openai', openai.__version__)" || exit 1
  python3 -c "import strata_mlx._reader" 2>/dev/null || python3 setup.py build_ext --inplace -q 2>&1 | tail -1
  [ -f "$SYNTH/manifest.json" ] || /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx convert \
     --synthetic qwen3-next-80b-a3b --mlx-path "$SYNTH" --calibration-tokens 256 2>&1 | grep -v "experts:" | tail -3
  if [ "$1" = serve ]; then
    timeout 480 python3 benchmarks/serve_concurrency.py "$SYNTH" --arena-gb 6.5 --levels 1,2,4,8 \
       --max-tokens 32 --prompt-tokens 64 --deadline-s 400 2>&1 | tee "$OUT/serve-concurrency.log"
  else
    timeout 540 python3 benchmarks/resume_ttft.py "$SYNTH" --arena-gb 6.5 --prompt-tokens 16384 \
       --rounds 2 --json "$OUT/resume-ttft.json" 2>&1 | tee "$OUT/resume-ttft.log"
  fi
  ;;
*) echo "usage: $0 setup|synth|bench|kernels|full|decode|decode-arena|prefill-old|sched1|sched2|sched3|r7a|r7b|r7c|r7d|r8a|r8b|r9a|r9b|r9c|r9d|r9e|r10a|r10b|r10b2|r10c|r10d|r11a|r11b|r11c|r11d|r12a|r12b|r12c|r12d|r12e|r12f|r13|r13c|r14|r14b|kcall|serve|resume"; exit 2;;
esac
