#!/usr/bin/env bash
# Session 2, call B on the 4-GPU machine (~9 min): the window transport on
# GPUs (tests), the copy-engine path across processes (4x1 and 2x2
# correctness, a stalled peer), and the all-gather table in one process
# (both transports) beside the 4-process and 2x2 layouts.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
S=$(date +%s); END=$((S + ${TOTAL_S:-570}))
LOG=$OUT/session6.txt; : > "$LOG"
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local left=$((END - $(date +%s)))
  if (( left < 25 )); then echo "[$(( $(date +%s) - S ))s] SKIP $name" | tee -a "$LOG"; return; fi
  (( t > left )) && t=$left
  echo "[$(( $(date +%s) - S ))s] START $name (${t}s): $*" | tee -a "$LOG"
  timeout --kill-after=5 "$t" "$@" >> "$LOG" 2>&1
  echo "[$(( $(date +%s) - S ))s] END $name rc=$?" | tee -a "$LOG"
}
R=/tmp/ficco_results6; rm -rf "$R"; mkdir -p "$R"
step install 120 python3 -m pip install --no-build-isolation --no-deps .
step pytest_gpu 220 python3 -P -m pytest -q -p no:cacheprovider -rs \
  tests
step mp4x1_dma 100 python3 -m ficco_jax.launch -n 4 --timeout_s=90 tests/mp_worker.py dma
step bench_sp 130 python3 benchmarks/mp_ag_bench.py --out_dir="$R" --tag=sp_1x4 \
  --transports=rendezvous,window --schedules=ring:1:dma,direct:1:dma,ring:1:xla
step bench_mp4x1 90 python3 -m ficco_jax.launch -n 4 --timeout_s=85 \
  benchmarks/mp_ag_bench.py --out_dir="$R" --tag=mp_4x1 --schedules=ring:1:dma,direct:1:dma,ring:1:xla
step mp2x2_dma 90 python3 -m ficco_jax.launch -n 2 --timeout_s=85 tests/mp_worker.py dma
export FICCO_TEST_STALL_FILE=/tmp/ficco_stall_flag; rm -f $FICCO_TEST_STALL_FILE
step mp4x1_stall 60 python3 -m ficco_jax.launch -n 4 --timeout_s=55 tests/mp_worker.py stall
step bench_mp2x2 90 python3 -m ficco_jax.launch -n 2 --timeout_s=85 \
  benchmarks/mp_ag_bench.py --out_dir="$R" --tag=mp_2x2 --schedules=ring:1:dma,direct:1:dma,ring:1:xla
cp "$R"/* "$OUT"/ 2>/dev/null
grep -E "START|END|SKIP|passed|failed|stall:|^\| " "$LOG" | head -80
