#!/usr/bin/env bash
# The fast-drive benchmark on the GPU machine: the full-size synthetic store on the machine's
# disk and copied to a tmpfs (/dev/shm, a "drive" of ~29 GB/s, standing in for a laptop's
# 6-17 GB/s SSD), so that the engine, not the drive, shows where the time goes. Each stage fits
# one device call (docs/benchmarks.md has the tables and what they answer). From the repo root
# there, after ../shared/device's MLX CUDA install:
#   export PYTHONPATH=/tmp/site; bash benchmarks/fast_drive.sh store|shm|path|bench|profile|disk|evict|extra|plan|resident|old-vs-new|alternate|wide|laptop|orders|conns|gate|gate-copy|trace|stalls|gated|hostprof|decodewait|disktrace|readcost|chain|spin|membw|defaults|pairs|widen|gil|kprofile|quick|miss|spread|gatestalls|fused|duel
# Policies name options beside the defaults of the code run: gated decode on CUDA runs with
# the routing board by default, 4 layers a commit, checked 4 behind (`:bd1` is
# `:bd1:lc4:lag4`); without it (OLDGT below, `:bd0:lc1:lag1`) each layer alone, checked 1
# behind; held copies give their gates up after 50 ms (`:ch50`; `:ch0` off).
# Logs land in $OUT (the device tool brings them back). READPATH=0 skips store's data-path
# variants, BATCH=0 extra's batched decode; ARENA (GB, 6.5) sizes bench's arena.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
DISK=${DISK:-/root/strata-synth}   # the store on the machine's disk
SHM=${SHM:-/dev/shm/strata-synth}  # the same store on tmpfs
OLD=${OLD:-$PWD/.old}  # a tree of the code to compare against (git archive; ignored: carry it)
OLDGT=${OLDGT-:bd0:lc1:lag1}       # gated decode's options without the routing board
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # (a native crash prints every thread's Python stack)
# (the package's own default, set here too for the scripts that start CUDA before importing it,
# and so for the old tree's code as well; CUDA's own is 8, which `conns` compares)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$PWD"
# MLX compiles its own CUDA kernels at their first use and keeps them in MLX_PTX_CACHE_DIR
# (mx.fast.cuda_kernel's, the package's expert and gate kernels, it compiles in every process);
# a fresh machine spent ~65 s of the synthetic store's first calibration layer compiling, the
# share of MLX's own not measured. The cache, one folder per MLX version under PTX_ROOT: a copy
# carried in (PTX_IN, a .tgz in the working tree) is unpacked first, and the cache goes back
# as $OUT/ptx.tgz when a stage added to it (carry it next time; the device tool returns files
# up to 16 MiB, 8 a call).
PTX_ROOT=${PTX_ROOT:-/tmp/mlx-ptx}
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$PTX_ROOT/$(python3 -c \
  'import importlib.metadata as m; print(m.version("mlx"))' 2>/dev/null || echo unknown)}
PTX_IN=${PTX_IN:-.device/ptx.tgz}
if [ -f "$PTX_IN" ]; then
  mkdir -p "$PTX_ROOT" && tar -xzf "$PTX_IN" --skip-old-files -C "$PTX_ROOT"
fi
ptx_files() { find "$PTX_ROOT" -type f 2>/dev/null | wc -l; }
ptx_before=$(ptx_files)
trap '[ "$(ptx_files)" -gt "$ptx_before" ] && tar -czf "$OUT/ptx.tgz" -C "$PTX_ROOT" .' EXIT
# (this Python's own extension suffix: a tree copied from another machine may hold another's)
built() { [ -f "strata_mlx/_reader$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" ]; }
build() { built || python3 setup.py build_ext --inplace -q 2>&1 | tail -2; }
synth() {  # DIR: the full-size synthetic store written there, unless it is already
  [ -f "$1/manifest.json" ] || /usr/bin/time -f "synthetic store: %e s" python3 -m strata_mlx \
     convert --synthetic qwen3-next-80b-a3b --mlx-path "$1" --calibration-tokens 256 2>&1 \
     | grep -v "experts:" | tail -2 | tee "$OUT/synth.log"
}
bench() {  # NAME STORE POLICIES [extra bench args]: this code's bench, logged as NAME
  local name=$1 store=$2 pol=$3; shift 3
  timeout "${LIMIT:-560}" python3 -m strata_mlx bench --model "$store" -p 2048 -g "${G:-128}" \
    --arena-gb "${ARENA:-6.5}" --prefill-step-size "${STEP:-1024}" --policies "$pol" --json "$OUT/$name.json" "$@" \
    2>&1 | tee "$OUT/$name.log" | grep -v "^ *[0-9]"
}
spybin() {  # py-spy's binary from its wheel in .whl/base (extracted once); empty without it
  local w; w=$(ls .whl/base/py_spy-*.whl 2>/dev/null | head -1)
  [ -n "$w" ] || return 0
  ls /tmp/spy/py_spy-*.data/scripts/py-spy >/dev/null 2>&1 ||
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/spy')" "$w"
  chmod +x /tmp/spy/py_spy-*.data/scripts/py-spy && ls /tmp/spy/py_spy-*.data/scripts/py-spy
}
evals() {  # one profile_decode --evals run on the tmpfs store (behind STRATA_MLX_DRIVE_GBPS
  # where set, as the caller's environment has it): its token's lines
  timeout 100 python3 benchmarks/profile_decode.py "$SHM" --arena-gb 6.5 -p 1024 -g 48 --skip 4 \
    --no-profile --evals "$@" 2>&1 | grep -A5 "isolate:\| ms/token; a token"
}
case "${1:-}" in
store)  # the store on disk and on tmpfs; the reader's GPU tests; the drive and the data path
  build
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.log"
  synth "$DISK"
  [ -f "$SHM/manifest.json" ] || (/usr/bin/time -f "copy to tmpfs: %e s" cp -r "$DISK" "$SHM") 2>&1 \
     | tee -a "$OUT/synth.log"
  df -h / /dev/shm | tee "$OUT/df.log"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/stream/test_reader.py \
     tests/stream/test_arena.py tests/stream/test_lookahead.py tests/runtime/test_streaming.py \
     tests/runtime/test_kernels.py 2>&1 | tail -8 | tee "$OUT/tests.log"
  for s in "$DISK" "$SHM"; do
    python3 -m strata_mlx probe-ssd "$s/experts.bin" --record-bytes 983040 --seconds 2 2>&1 | tee -a "$OUT/probe.log"
  done
  [ "${READPATH:-1}" = 0 ] || timeout 120 python3 benchmarks/read_path.py "$SHM" --touch --seconds 2 \
     --rounds 3 --variants bounce+verify+overlap,bounce+verify+overlap+dc,bounce+verify+overlap+dc+dm,bounce+overlap+dc+dm \
     2>&1 | tee "$OUT/read-path-shm.log"
  ;;
shm)  # the store written straight to the tmpfs (no disk copy, tests or probes: ~150-180 s on
  # the GPU machine), for the stages that read only $SHM
  build
  synth "$SHM"
  ;;
bench)  # tmpfs: each policy with the arena in device memory (the default on CUDA) and in
  # managed memory (:da0)
  build
  bench "bench-shm" "$SHM" "${POL:-demand:da0,demand,lookahead:da0,lookahead}"
  ;;
defaults)  # the defaults (the routing board, held copies given up after 50 ms) against the
  # board off (:bd0) and the held-copy option off (:ch0): the gate's GPU tests (fresh models
  # waiting out no gate, the board on and off; a copy held behind its gate; GATE_TESTS=0 skips
  # them), the fresh-models test with the board RERUNS times more (3), bench of POL on the
  # tmpfs, or behind an emulated DRIVE GB/s drive where set; one profile_decode run of demand
  # for a miss's read, step by step; how late the board's waits see a word on this host
  # (benchmarks/wait_word_latency.py). ~9 min on a fresh machine; the second call:
  # GATE_TESTS=0 DRIVE=6.
  build
  synth "$SHM"
  if [ "${GATE_TESTS:-1}" != 0 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gate.py 2>&1 |
      tail -80 > "$OUT/gate-tests.log"; tail -4 "$OUT/gate-tests.log"
    for i in $(seq "${RERUNS:-3}"); do
      timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gate.py \
        -k "give_up_no_gate and True" 2>&1 | grep -E "^E |passed|failed" | head -4
    done | tee "$OUT/fresh-reruns.log"
  fi
  pol=${POL:-lookahead,lookahead:bd0,lookahead:ch0,demand}
  STRATA_MLX_DRIVE_GBPS=${DRIVE:-} G=${G:-64} LIMIT=${LIMIT:-220} bench "bench-defaults-${DRIVE:-shm}" "$SHM" "$pol"
  STRATA_MLX_DRIVE_GBPS=${DRIVE:-} evals --policy demand | tee "$OUT/defaults-steps-${DRIVE:-shm}.log"
  python3 benchmarks/wait_word_latency.py --slack-ns 0,5000,1000 2>&1 | tee "$OUT/wait-word.log"
  ;;
profile)  # tmpfs: where decode's and prefill's host time goes (cProfile)
  build
  timeout 120 python3 benchmarks/profile_decode.py "$SHM" --arena-gb 6.5 -p 1024 -g 48 \
     --policy lookahead --top 45 2>&1 | tee "$OUT/profile-decode.log" | head -60
  timeout 150 python3 benchmarks/profile_decode.py "$SHM" --arena-gb 6.5 -p 4096 --prefill \
     --policy "${PPOL:-lookahead}" --top 45 2>&1 | tee "$OUT/profile-prefill.log" | head -70
  ;;
path)  # tmpfs: the data path's steps (benchmarks/read_path.py), 8 and 12 reader workers
  build
  for w in ${WORKERS:-8 12}; do
    timeout 150 python3 benchmarks/read_path.py "$SHM" --touch --seconds 2 --rounds 3 --workers $w \
      --variants "${VARIANTS:-bounce+verify+overlap+dc+dm,bounce+verify+overlap+dc+dm+cb,bounce+overlap+dc+dm,bounce+overlap+dc+dm+cb}"
  done 2>&1 | tee "$OUT/read-path.log"
  ;;
disk)  # the machine's own disk: each policy with the CPU copy (:dc0, the code before the copy
  # engine), the arena in managed memory (:da0) and in device memory (the default)
  build
  G=${G:-32} bench "bench-disk" "$DISK" "${POL:-demand:dc0,demand:da0,demand,lookahead:dc0,lookahead:da0,lookahead}"
  ;;
old-vs-new)  # `old-vs-new STORE ROUND`: the old tree's bench, then this code's, same store
  build; (cd "$OLD" && build)
  (cd "$OLD" && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" timeout 280 python3 -m strata_mlx bench --model "$2" \
     -p 2048 -g "${G:-32}" --arena-gb 6.5 --prefill-step-size 1024 --policies demand,lookahead \
     --json "$OUT/old-bench-$3.json" 2>&1 | tee "$OUT/old-bench-$3.log" | grep -v "^ *[0-9]")
  LIMIT=280 bench "new-bench-$3" "$2" demand,lookahead
  ;;
evict)  # tmpfs: LRU beside the default (lookahead, nextuse-duel) and the other expected-next-use
  # candidates, the duel's read-ahead scored or not, live, with the routing traces (strata-mlx
  # cache-sim replays them: docs/research.md); POL=demand:lru,demand,demand:nextuse for demand
  build
  mkdir -p "$OUT/trace"
  G=${G:-64} LIMIT=${LIMIT:-540} bench "bench-evict" "$SHM" \
    "${POL:-lookahead:lru,lookahead,lookahead:nextuse,lookahead:sc1}" \
    --trace "$OUT/trace/t.npz"
  ;;
extra)  # tmpfs: decode's host time per layer (replayed), plan's forecast of this store (its
  # calibration included) and batched decode at 1-8 requests (benchmarks/batch_decode.py); one log
  build
  { timeout 90 python3 benchmarks/decode_host.py "$SHM" --arena-gb 6.5 -p 1024 -g 48 --parts
    timeout 150 python3 -m strata_mlx plan "$SHM" --arena-gb 6.5 -p 2048 -g 128 \
       --prefill-step-size 1024 --json "$OUT/plan.json"
    [ "${BATCH:-1}" = 0 ] || timeout 150 python3 benchmarks/batch_decode.py "$SHM" --arena-gb 6.5 \
       --levels 1,2,4,8 --prompt-tokens 64 --max-tokens 16 --rounds 1; } 2>&1 | tee "$OUT/extra.log"
  ;;
plan)  # tmpfs: plan against bench's cold lookahead, ROUNDS rounds (benchmarks/plan_vs_bench.py;
  # the first round's plan calibrates where the cache has no entry for this code's calibration)
  build
  timeout 560 python3 benchmarks/plan_vs_bench.py --store "$SHM" --arena-gb 6.5 -p 2048 \
     -g "${G:-32}" --prefill-step-size 1024 --rounds "${ROUNDS:-3}" \
     --json "$OUT/plan-vs-bench.json" 2>"$OUT/plan-vs-bench.err" | tee "$OUT/plan-vs-bench.log"
  ;;
resident)  # every expert resident, beside mlx-lm's own model, interleaved (benchmarks/decode.py):
  # "token" mode with the whole token in one submit (the default) and 4 layers a submit
  build
  timeout 560 python3 benchmarks/decode.py "$SHM" -p 2048 -g 128 --rounds "${ROUNDS:-3}" \
     --modes "${MODES:-token,token:4}" --json "$OUT/resident.json" 2>&1 | tee "$OUT/resident.log"
  ;;
alternate)  # tmpfs: the old tree's bench and this code's, alternating ROUNDS times (POL for
  # both, NEWPOL this code's extra variants, once), then decode's host time a layer of each
  build; (cd "$OLD" && build)
  for r in $(seq "${ROUNDS:-2}"); do
    (cd "$OLD" && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" timeout 200 python3 -m strata_mlx bench --model "$SHM" \
       -p 2048 -g "${G:-32}" --arena-gb 6.5 --prefill-step-size 1024 --policies "${POL:-lookahead,demand}" \
       --json "$OUT/old-bench-$r.json" 2>&1 | tee "$OUT/old-bench-$r.log" | grep -v "^ *[0-9]")
    LIMIT=200 bench "new-bench-$r" "$SHM" "${POL:-lookahead,demand}"
  done
  [ -z "${NEWPOL:-}" ] || LIMIT=200 bench "new-bench-extra" "$SHM" "$NEWPOL"
  { for code in old new; do
      tree=$PWD; [ $code = old ] && tree=$OLD
      echo "== $code"; PYTHONPATH="${PYTHONPATH%%:*}:$tree" timeout 90 python3 "$tree/benchmarks/decode_host.py" \
        "$SHM" --arena-gb 6.5 -p 1024 -g 48 --parts
    done; } 2>&1 | tee "$OUT/decode-host.log"
  ;;
wide)  # the dequantize kernel's 16-byte stores (the default) against its scalar ones: the
  # kernel alone (outputs equal, times), then bench's lookahead with each, alternating
  build
  timeout 120 python3 benchmarks/dequant_stores.py 2>&1 | tee "$OUT/dequant-stores.log"
  for r in 1 2; do
    STRATA_MLX_DEQUANT_STORES=scalar G=${G:-32} LIMIT=200 bench "bench-scalar-$r" "$SHM" lookahead
    STRATA_MLX_DEQUANT_STORES=wide G=${G:-32} LIMIT=200 bench "bench-wide-$r" "$SHM" lookahead
  done
  ;;
laptop)  # tmpfs behind an emulated laptop drive (STRATA_MLX_DRIVE_GBPS; DRIVES, GB/s): bench's
  # policies against that drive's floors (its probes read through the same drive)
  build
  for d in ${DRIVES:-12 6}; do
    STRATA_MLX_DRIVE_GBPS=$d G=${G:-32} LIMIT=${LIMIT:-280} bench "bench-drive$d" "$SHM" "${POL:-lookahead,demand}"
  done
  ;;
orders)  # tmpfs behind an emulated drive (DRIVE, GB/s; empty: the tmpfs itself): ROUNDS benches
  # of POL's two policies, their order swapped each round (the machine drifts within a call)
  build
  a=${POL%%,*}; b=${POL#*,}
  for r in $(seq "${ROUNDS:-3}"); do
    p="$a,$b"; [ $((r % 2)) = 0 ] && p="$b,$a"
    STRATA_MLX_DRIVE_GBPS=${DRIVE:-} G=${G:-32} LIMIT=${LIMIT:-150} bench "bench-orders-$r" "$SHM" "$p"
  done
  ;;
gate)  # gated decode: the gate's GPU tests (the kernel waits for a host store, gives up past
  # its timeout, a gated decode equals the per-layer handshake), then bench's POL (default:
  # lookahead, gated at lag 1 and 2) on the tmpfs behind each of DRIVES (GB/s; shm: the tmpfs
  # itself), the order reversed every other drive; GATE_TESTS=0 skips the tests
  build
  [ "${GATE_TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gate.py 2>&1 \
     | tail -6 | tee "$OUT/gate-tests.log"
  pol=${POL:-lookahead:gt0,lookahead:gt1$OLDGT,lookahead:gt1:bd0:lc1:lag2}; r=0
  rev=$(echo "$pol" | tr , '\n' | tac | paste -sd,)
  for d in ${DRIVES:-12 shm}; do  # shm: the tmpfs itself, no emulated drive
    r=$((r + 1)); p=$pol; [ $((r % 2)) = 0 ] && p=$rev; g=$d; [ "$d" = shm ] && g=
    STRATA_MLX_DRIVE_GBPS=$g G=${G:-32} LIMIT=${LIMIT:-200} bench "bench-gate-$d" "$SHM" "$p"
  done
  ;;
conns)  # tmpfs (behind DRIVE GB/s where set): bench's POL under 8 hardware queues (CUDA's
  # default) and 32 (the package's), ROUNDS times, the order swapped each round: whether the
  # reader threads' copies queued behind MLX's kernels cost the ungated path too
  build
  for r in $(seq "${ROUNDS:-2}"); do
    cs="8 32"; [ $((r % 2)) = 0 ] && cs="32 8"
    for c in $cs; do
      CUDA_DEVICE_MAX_CONNECTIONS=$c STRATA_MLX_DRIVE_GBPS=${DRIVE:-} G=${G:-32} LIMIT=${LIMIT:-130} \
        bench "bench-conns$c-$r" "$SHM" "${POL:-lookahead,demand}"
    done
  done
  ;;
gate-copy)  # which of MLX's calls holds a record's device copy while a gate waits, and whether
  # reader threads' copy streams sharing MLX's hardware queue do (benchmarks/gate_copy.py, 16
  # threads), under each of CONNS (CUDA_DEVICE_MAX_CONNECTIONS: 8 is CUDA's default, 32 the
  # package's); then gated decode behind a 12 GB/s emulated drive under each, few tokens, a
  # short timeout (the gates given up are bench's figure: every one counted, gating never
  # stopped)
  build
  for c in ${CONNS:-8 32}; do
    echo "== CUDA_DEVICE_MAX_CONNECTIONS=$c"
    CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 90 python3 benchmarks/gate_copy.py --workers 16 --behind 2>&1
  done | tee "$OUT/gate-copy.log"
  for c in ${CONNS:-8 32}; do
    CUDA_DEVICE_MAX_CONNECTIONS=$c STRATA_MLX_DRIVE_GBPS=12 STRATA_MLX_GATE_TIMEOUT_MS=100 \
      G=${G:-4} LIMIT=${LIMIT:-180} bench "gate-conn$c" "$SHM" "${POL:-lookahead:gt1:gg0}"
  done
  ;;
trace)  # why gated decode's gates give up (benchmarks/gate_trace.py): each gated layer's
  # check and its experts' gate-table words, and MLX's memory grown a token, on the quarter
  # store behind a 12 GB/s emulated drive, a 100 ms timeout: generate alone (-p 2048, TPOL,
  # the routing board by default), the same after a fake-stream model was loaded, run and
  # closed (as bench's floor is), then bench's POL traced in-process
  build
  q=/dev/shm/strata-synth-12
  [ -f "$q/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$q" --calibration-tokens 256 --set num_hidden_layers=12 2>&1 | grep -v "experts:" | tail -1
  export STRATA_MLX_DRIVE_GBPS=12 STRATA_MLX_GATE_TIMEOUT_MS=100
  tp=${TPOL:-lookahead:gt1:gg0:bd1}
  { timeout 90 python3 benchmarks/gate_trace.py "$q" --arena-gb 1.6 -p 2048 -g 6 --detail 1 --policy "$tp"
    timeout 110 python3 benchmarks/gate_trace.py "$q" --arena-gb 1.6 -p 2048 -g 6 --detail 1 --after-floor \
      --policy "$tp"
    timeout 250 python3 benchmarks/gate_trace.py --detail 2 --bench --model "$q" -p 2048 -g "${G:-6}" \
      --arena-gb 1.6 --prefill-step-size 1024 --policies "${POL:-lookahead:gt1:gg0:bd1,lookahead:gt1:gg0}"
  } 2>&1 | cut -c1-1500 | tee "$OUT/gate-trace.log"
  ;;
gated)  # the gate's GPU tests (the routing board's kernel among them); then on the tmpfs:
  # lookahead ungated (`:gt0`; gated is the default on CUDA), gated, and gated with prefill's
  # ready words stored by the driver (`:pw1`):
  # what the driver's host functions behind each copy cost prefill's reads; then each
  # thread's CPU time a gated token against its wall (the GIL). The decode side's variants,
  # in a call of their own (~6 min): POL=lookahead:gt1:bd1,lookahead:gt1:bd1:lc4:lag4,lookahead:gt1:lc4,demand:gt1
  # (the routing board: no command buffer a layer for its check; with the decoder's commits
  # every 4 layers and the checks 4 behind; the decoder's commit every 4 layers alone; no
  # prediction's Python in the checks)
  build
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu${TAG:-}.log"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gate.py 2>&1 \
     | tail -12 | tee "$OUT/gate-tests${TAG:-}.log"
  synth "$SHM"
  G=${G:-32} bench "bench-gated${TAG:-}" "$SHM" "${POL:-lookahead:gt0,lookahead:gt1,lookahead:gt1:pw1}"
  for p in ${PROFILE_POL:-lookahead:gt1$OLDGT lookahead:gt1:bd1:lc1:lag1 lookahead:gt0}; do
    timeout 100 python3 benchmarks/profile_decode.py "$SHM" --arena-gb 6.5 -p 1024 -g 32 \
      --policy $p --no-profile 2>&1 | tail -2
  done | tee "$OUT/gated-threads${TAG:-}.log"
  ;;
hostprof)  # tmpfs: where each decode thread's CPU goes, MLX's and CUDA's calls included
  # (profile_decode.py --no-profile --py-spy: native stacks sampled while 32 tokens decode),
  # gated and not; needs py-spy's wheel in .whl/base
  build
  spy=$(spybin)
  [ -n "$spy" ] || { echo "hostprof: no py-spy wheel in .whl/base"; exit 1; }
  synth "$SHM"
  for p in ${PROFILE_POL:-lookahead:gt1 lookahead:gt0}; do
    timeout 150 python3 benchmarks/profile_decode.py "$SHM" --arena-gb 6.5 -p 1024 -g 32 \
      --policy $p --no-profile --py-spy "$spy" --top 30
  done 2>&1 | cut -c1-300 | tee "$OUT/hostprof.log"
  ;;
stalls)  # what holds bench's gated decode (benchmarks/gate_trace.py), on trace's quarter store:
  # bench traced with the stacks of every build step that stalls 60 ms dumped (faulthandler)
  # and, with py-spy's wheel in .whl/base, every thread's native stack while a word is late;
  # then the same with Python's GC off
  build
  q=/dev/shm/strata-synth-12
  [ -f "$q/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$q" --calibration-tokens 256 --set num_hidden_layers=12 2>&1 | grep -v "experts:" | tail -1
  spy=()
  [ -z "$(spybin)" ] || spy=(--py-spy "$(spybin)" "$OUT/spy-bench.txt")
  export STRATA_MLX_DRIVE_GBPS=12 STRATA_MLX_GATE_TIMEOUT_MS=100
  b=(--bench --model "$q" -p 2048 -g "${G:-6}" --arena-gb 1.6 --prefill-step-size 1024 --policies "${POL:-lookahead:gt1:gg0}")
  { timeout 200 python3 benchmarks/gate_trace.py --detail 2 --stacks "$OUT/stacks-bench.txt" "${spy[@]}" "${b[@]}"
    [ "${NOGC:-1}" = 0 ] || timeout 200 python3 benchmarks/gate_trace.py --detail 1 --no-gc "${b[@]}"
  } 2>&1 | cut -c1-1500 | tee "$OUT/gate-stalls.log"
  ;;
disktrace)  # the gate a bench's first cold run gave up on the machine's disk, traced
  # (benchmarks/gate_trace.py with bench in-process): the store copied to DISK, `-p 1024`, whole
  # records, a TIMEOUT of 500 ms (a miss there takes a few ms)
  build
  synth "$SHM"
  [ -f "$DISK/manifest.json" ] || cp -r "$SHM" "$DISK"
  STRATA_MLX_GATE_TIMEOUT_MS=${TIMEOUT:-500} timeout 300 python3 benchmarks/gate_trace.py \
    --detail 2 --bench --model "$DISK" -p 1024 -g "${G:-24}" --arena-gb 6.5 \
    --prefill-step-size 1024 --policies "${POL:-demand:gt1:s0}" 2>&1 | cut -c1-1500 \
    | tee "$OUT/disk-trace.log"
  ;;
decodewait)  # tmpfs: where a gated token's time goes, policy by policy (profile_decode.py
  # --evals: the device at its gates, the decoding thread's CPU inside and outside MLX's
  # evaluations, the checks' CPU), each under each of SWITCH (Python's switch interval, s: how
  # long the checks' thread may wait for the GIL the decoding thread holds). Predicting in
  # decode or not, in bench: POL=lookahead:gt1,lookahead:never:gt1,demand:gt1 ... bench
  build
  synth "$SHM"
  for si in ${SWITCH:-0.005 0.0001}; do
    for p in ${PROFILE_POL:-demand:gt1$OLDGT demand:gt1$OLDGT:s0 demand:gt1:bd1:lc1:lag1 lookahead:gt1$OLDGT lookahead:never:gt1$OLDGT}; do
      echo "== switch interval $si s, $p"
      timeout 100 python3 -c "import runpy, sys; sys.setswitchinterval(float(sys.argv.pop(1))); \
sys.argv[0] = 'benchmarks/profile_decode.py'; runpy.run_path(sys.argv[0], run_name='__main__')" \
        "$si" "$SHM" --arena-gb 6.5 -p 1024 -g 48 --skip 4 --policy "$p" --no-profile --evals \
        2>&1 | grep -A2 " ms/token; a token"
    done
  done 2>&1 | tee "$OUT/decodewait.log"
  ;;
readcost)  # tmpfs: what a read costs the decoding thread. Its CPU inside MLX's evaluations and
  # outside them both grow with the reads a token, in roughly the same proportion, much as a
  # thread that runs slower would: records not verified (:nv), fewer reader threads (:io4), the
  # routing board committing every 4 layers (:bd1:lc4:lag4), each beside demand:gt1 and the
  # floor (every expert counted resident), in one process each; then demand:gt1 with the
  # decoding thread alone on a physical core (whether the threads beside it slow it). The gate's
  # and the reader's GPU tests run while the store is written (GATE_TESTS=0 leaves them out).
  build
  if [ "${GATE_TESTS:-1}" != 0 ]; then
    synth "$SHM" &
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gate.py \
      tests/stream/test_reader.py -k "gate or lands" 2>&1 | tail -4 | tee "$OUT/readcost-tests.log"
    wait
  else
    synth "$SHM"
  fi
  for p in ${PROFILE_POL:-demand:gt1$OLDGT demand:gt1$OLDGT:nv demand:gt1$OLDGT:io4 \
           demand:gt1:bd1:lc4:lag4 lookahead:gt1$OLDGT}; do
    echo "== $p"; evals --policy "$p"
  done 2>&1 | tee "$OUT/readcost.log"
  # ... and with the decoding thread alone on a physical core (profile_decode --isolate)
  for p in ${ISOLATE_POL:-demand:gt1$OLDGT}; do
    echo "== $p, isolated"; evals --policy "$p" --isolate
  done 2>&1 | tee -a "$OUT/readcost.log"
  echo "== every expert counted resident" | tee -a "$OUT/readcost.log"
  evals --policy demand --fake-stream | tee -a "$OUT/readcost.log"
  ;;
chain)  # the chain through a gated token's gates: a miss's read from submission to landing,
  # and the token against a delay added to each check before its reads are submitted
  # (profile_decode.py --evals --check-delay-ms; the slope says how much of a check's latency
  # the token pays), demand:gt1 on each of DRIVES (shm: the raw tmpfs; N: behind an emulated
  # N GB/s drive), then each of LOOK undelayed (lookahead's gated token is the host's: with
  # the routing board committing every 4 layers, and predicting one layer ahead). One drive
  # fits a device call: DRIVES=6 for the second.
  build
  synth "$SHM"
  o=$OLDGT
  run() { STRATA_MLX_DRIVE_GBPS=$g evals "$@"; }  # (through drive $g)
  for d in ${DRIVES:-shm}; do
    g=$d; [ "$d" = shm ] && g=
    for x in ${DELAYS:-0 0.25 0.5}; do
      echo "== drive $d, demand:gt1$o, checks delayed $x ms"; run --policy "demand:gt1$o" --check-delay-ms "$x"
    done
    for p in ${LOOK:-lookahead:gt1$o lookahead:gt1:bd1:lc4:lag4 lookahead:gt1$o:d1}; do
      echo "== drive $d, $p"; run --policy "$p"
    done
    # (Python's switch interval: how long the check may wait for the GIL the building thread
    # holds; CPython's 5 ms against SWITCH us)
    for p in ${SWPOL:-demand:gt1$o lookahead:gt1$o}; do
      echo "== drive $d, $p, switch interval ${SWITCH:-100} us"; run --policy "$p" --switch-us "${SWITCH:-100}"
    done
  done 2>&1 | tee "$OUT/chain.log"
  ;;
spin)  # the reader's idle threads polling for work (:rsN, N us; :rnK threads at once)
  # against sleeping (each miss's read then waits for a thread's wake-up): gated decode's
  # token, a miss's read from submission to landing, rounds alternating (profile_decode.py
  # --evals); demand on the tmpfs and behind an emulated 6 GB/s drive, lookahead with the
  # routing board on the tmpfs. SPIN: the variant tried (":rs2000:rn4").
  build
  synth "$SHM"
  run() { STRATA_MLX_DRIVE_GBPS=$g evals "$@"; }  # (through drive $g)
  sp=${SPIN:-:rs2000:rn4}
  { for g in "" "" 6; do
      for p in "demand:gt1$OLDGT" "demand:gt1$OLDGT$sp"; do echo "== drive ${g:-shm}, $p"; run --policy "$p"; done
    done
    g=
    for p in lookahead:gt1:bd1:lc4:lag4 "lookahead:gt1:bd1:lc4:lag4$sp"; do
      echo "== drive shm, $p"; run --policy "$p"
    done
  } 2>&1 | tee "$OUT/spin.log"
  ;;
membw)  # tmpfs: the host's memory copy rate beside probe-ssd and the data path (whether the
  # tmpfs data path is bound by memory: four passes over it against the probe's two)
  build
  synth "$SHM"
  { python3 benchmarks/memory_copy.py --threads 8,16 --seconds 2
    python3 -m strata_mlx probe-ssd "$SHM/experts.bin" --record-bytes 983040 --seconds 2
    timeout 150 python3 benchmarks/read_path.py "$SHM" --touch --seconds 2 --rounds 3 \
      --variants bounce+verify+overlap+dc+dm+cb,bounce+overlap+dc+dm+cb 2>&1 | tail -3
    python3 benchmarks/memory_copy.py --threads 8,16 --seconds 2
  } 2>&1 | tee "$OUT/membw.log"
  ;;
widen)  # decode's lookahead wider than the router's top k (:xN, N more experts a layer ahead),
  # and a miss's checksum taken while its copy runs (:vc1): bench on the tmpfs, then behind an
  # emulated DRIVES GB/s drive each (misses against reads). ~9 min on a fresh machine
  build
  synth "$SHM"
  for d in "" ${DRIVES:-6}; do
    STRATA_MLX_DRIVE_GBPS=$d G=${G:-64} LIMIT=${LIMIT:-250} bench "bench-widen-${d:-shm}" "$SHM" \
      "${POL:-lookahead,lookahead:x5,lookahead:x10,lookahead:vc1}"
  done
  ;;
gil)  # tmpfs: a gated token's chain with the checks' waits for the GIL once their layer's
  # routing is on the board (profile_decode.py --evals, each of PROFILE_POL)
  build
  synth "$SHM"
  for p in ${PROFILE_POL:-demand lookahead}; do echo "== $p"; evals --policy "$p"; done 2>&1 \
    | tee "$OUT/gil.log"
  ;;
quick)  # quick misses (stream.quick: the reader's own thread reads a gated layer's misses off
  # the routing board into a reserve of slots; the default on CUDA): their GPU tests and the
  # device gate's equality test, then bench's POL on the tmpfs (default: demand and lookahead,
  # each with the defaults and with the path before them, :qm0, and lookahead reading its
  # predictions off the board too, :qa1); TESTS=0 skips the tests
  build
  synth "$SHM"
  [ "${TESTS:-1}" = 0 ] || timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
     tests/runtime/test_quick.py tests/runtime/test_gate.py -k "quick or equals_sync" 2>&1 \
     | tail -6 | tee "$OUT/quick-tests.log"
  bench "bench-quick" "$SHM" "${POL:-demand,demand:qm0,lookahead,lookahead:qm0,lookahead:qa1}"
  ;;
miss)  # tmpfs: a decode miss's read alone (benchmarks/miss_latency.py: batches of a gated
  # layer's misses, MISSES records each, from submission until their ready words say landed),
  # the reader's defaults beside VARIANTS (a batch spread over every idle thread, threads
  # polling for work, part sizes, the checksum beside the copy or none, more threads)
  build
  synth "$SHM"
  for k in ${MISSES:-2 4}; do
    timeout 200 python3 benchmarks/miss_latency.py "$SHM" --misses "$k" --rounds 2 \
      --variants "${VARIANTS:-base,sp1,s128:sp1,s128,rs2000,s0,vc1,nv,w16:sp1,s128:sp1:w16}"
  done 2>&1 | tee "$OUT/miss-latency.log"
  ;;
spread)  # a layer's misses spread over every idle reader thread (read_spread, `:sp1`) against
  # the defaults: the quick misses' GPU tests (their spread twin is a CPU test), then bench of
  # POL twice on the tmpfs, the second in the reverse order (drift along a bench falls on both)
  build
  synth "$SHM"
  [ "${TESTS:-1}" = 0 ] || timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
     tests/runtime/test_quick.py tests/runtime/test_gate.py -k "quick or equals_sync" 2>&1 \
     | tail -30 | tee "$OUT/spread-tests.log" | tail -3
  pol=${POL:-demand,demand:sp1,lookahead:sp1,lookahead}
  G=${G:-64} bench "bench-spread-a" "$SHM" "$pol"
  G=${G:-64} bench "bench-spread-b" "$SHM" "$(echo "$pol" | tr ',' '\n' | tac | paste -sd,)"
  ;;
gatestalls)  # gated decode's stalls caught as they happen (benchmarks/gate_stalls.py): RUNS
  # generations (bench's cold run, then warm ones) of POL (demand) on LOADS fresh loads, gates
  # timing out after 1.5 s and never stopping the gate, a dump of the reads' state and every
  # thread's stack at a stall; the old tree's code first where $OLD holds one
  build
  synth "$SHM"
  spy=$(spybin)
  stalls() {  # TAG: this script over the code on PYTHONPATH (its dumps in one .tgz)
    STRATA_MLX_GATE_TIMEOUT_MS=${GATE_MS:-1500} timeout "${LIMIT:-200}" python3 "$root/benchmarks/gate_stalls.py" \
       "$SHM" --policy "${POL:-demand}" --loads "${LOADS:-2}" --runs "${RUNS:-4}" -g "${G:-64}" \
       --py-spy "$spy" --out "$OUT/stalls-$1" 2>&1 | grep -v "^ *[0-9]" | tee "$OUT/gate-stalls-$1.log"
    [ -d "$OUT/stalls-$1" ] && tar -czf "$OUT/stalls-$1.tgz" -C "$OUT" "stalls-$1" && rm -r "$OUT/stalls-$1"
  }
  root=$PWD
  if [ -d "$OLD" ]; then  # (.old is ignored by git: carried only where the call names it)
    (cd "$OLD" && build && PYTHONPATH="${PYTHONPATH%%:*}:$OLD" stalls old)
  else
    echo "no old tree at $OLD: this code's runs only"
  fi
  stalls new
  ;;
fused)  # the routing board's write and the gate in one kernel a layer (decode_gate_fused,
  # `:gf1`) against the two: their GPU tests, then bench of POL on the tmpfs
  build
  synth "$SHM"
  [ "${TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
     tests/runtime/test_gate.py tests/runtime/test_quick.py -k "board or quick_misses_through" 2>&1 \
     | tail -30 | tee "$OUT/fused-tests.log" | tail -3
  G=${G:-64} LIMIT=${LIMIT:-330} bench "bench-fused" "$SHM" "${POL:-demand,demand:gf1,lookahead:gf1,lookahead}"
  ;;
duel)  # decode's prediction kept only where its tokens are faster (lookahead_decode_duel,
  # `:dd1`) beside lookahead predicting, lookahead that never predicts in decode and demand:
  # bench of POL on the tmpfs, then behind each of DRIVES (GB/s, emulated; empty: none)
  build
  synth "$SHM"
  pol=${POL:-lookahead,lookahead:dd1,lookahead:never,demand,lookahead:dd1}
  G=${G:-128} LIMIT=${LIMIT:-330} bench "bench-duel" "$SHM" "$pol"
  for d in ${DRIVES-}; do
    STRATA_MLX_DRIVE_GBPS=$d G=${G:-128} LIMIT=${LIMIT:-330} bench "bench-duel-drive$d" "$SHM" "$pol"
  done
  ;;
kprofile)  # a resident decode token's device time by kernel, strata-mlx beside mlx-lm (CUPTI
  # through PyTorch's profiler: benchmarks/kernel_profile.py), then the gate's GPU tests
  build
  synth "$SHM"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  timeout 300 python3 benchmarks/kernel_profile.py "$SHM" -p 256 -g "${G:-32}" --rounds "${ROUNDS:-2}" \
     2>&1 | grep -v "^STAGE:\|^USDT" | tee "$OUT/kernel-profile.log"
  if [ "${GATE_TESTS:-1}" != 0 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gate.py 2>&1 |
      tail -30 > "$OUT/gate-tests.log"; tail -3 "$OUT/gate-tests.log"
  fi
  ;;
pairs)  # one token's layers through the kernels' `pairs` against their general entry (the
  # call before): the call alone (a one-layer store of the full-size layout), the resident
  # decode beside mlx-lm (interleaved), and a resident token's host build beside mlx-lm's
  build
  one=/tmp/strata-q3n-1
  [ -f "$one/manifest.json" ] || python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b \
     --mlx-path "$one" --calibration-tokens 0 --set num_hidden_layers=1 --set num_experts=16 \
     --set vocab_size=256 2>&1 | tail -1
  timeout 100 python3 benchmarks/kernel_call.py "$one" --dtype bfloat16 2>&1 | tee "$OUT/pairs-call.log"
  timeout 300 python3 benchmarks/decode.py "$SHM" -p 2048 -g 48 --rounds "${ROUNDS:-3}" --interleave \
     --modes token:4,token:4+general --json "$OUT/pairs-resident.json" 2>&1 | tee "$OUT/pairs-resident.log"
  timeout 150 python3 benchmarks/token_build.py "$SHM" --rounds 3 --reps 30 2>&1 | tee "$OUT/pairs-build.log"
  ;;
*) echo "usage: $0 store|shm|path|bench|profile|disk|evict|extra|plan|old-vs-new STORE ROUND|alternate|resident|wide|laptop|orders|conns|gate|gate-copy|trace|stalls|gated|hostprof|decodewait|disktrace|readcost|chain|spin|membw|defaults|pairs|widen|gil|kprofile"; exit 2;;
esac
