#!/usr/bin/env bash
# First call on the 4-GPU machine: install, the test suite on the GPUs (the
# CUDA copy-engine path), a smoke benchmark of the all-gather matmul, and the
# cost model's characterisation. Everything lands in $OUT.
#   bash benchmarks/gpu_session1.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
LOG=$OUT/session1.log
START=$(date +%s)
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

log "install"
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.log" 2>&1 \
  || { log "install FAILED"; tail -40 "$OUT/install.log"; exit 1; }
python3 -c "import jax, ficco_jax; from ficco_jax._src.dma import library as l; print(jax.__version__, jax.devices(), 'cuda compiled:', l.cuda_compiled())" 2>&1 | tee -a "$LOG"

log "pytest on the GPUs"
# Run from tests/ so the installed package (with its library) is imported.
timeout ${PYTEST_S:-240} python3 -m pytest -q -p no:cacheprovider -rs \
  --import-mode=importlib tests -x --maxfail=20 -k "${PYTEST_K:-not test_tp_transformer}" \
  > "$OUT/pytest_gpu.txt" 2>&1
log "pytest rc=$?"; tail -25 "$OUT/pytest_gpu.txt"

log "smoke benchmark"
timeout ${SMOKE_S:-200} python3 benchmarks/ag_bench.py --axis_sizes=4 \
  --cases=16384x8192x8192,8192x8192x28672,4096x8192x8192 --models= --square=false \
  --schedules="${SMOKE_SCHEDULES:-default,direct/c1/dma,direct/c2/dma,direct/c4/dma,ring/c2/dma,bidirectional/c2/dma,direct/c2/dma/pallas}" \
  --peers= --out_dir="$OUT" --tag=smoke --time_budget_s=${SMOKE_S:-200} >> "$LOG" 2>&1
log "smoke rc=$?"

log "characterize"
timeout ${CHAR_S:-150} python3 benchmarks/characterize.py --out_dir="$OUT" \
  --time_budget_s=$(( ${CHAR_S:-150} - 20 )) >> "$LOG" 2>&1
log "characterize rc=$?"
ls -la "$OUT"
cat "$OUT"/*smoke*.md 2>/dev/null | head -60
