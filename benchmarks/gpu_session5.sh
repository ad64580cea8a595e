#!/usr/bin/env bash
# Session 2, call A on the 4-GPU machine (~7 min): the flag/IPC probe that the
# symmetric transport rests on, the GPU test suite after the protocol
# refactors, and the tensor-parallel block with a copy-engine schedule.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] $*"; }
{
  t probe
  nvcc -O2 -o /tmp/symm_probe xla_ffi/tools/symm_probe.cu 2>&1 | grep -v deprecat
  timeout 60 /tmp/symm_probe single
  rm -rf /tmp/ipcx; mkdir -p /tmp/ipcx
  CUDA_VISIBLE_DEVICES=0 timeout 60 /tmp/symm_probe ipc 0 /tmp/ipcx &
  CUDA_VISIBLE_DEVICES=2 timeout 60 /tmp/symm_probe ipc 1 /tmp/ipcx
  wait
} > "$OUT/probe.txt" 2>&1
cat "$OUT/probe.txt"
t install
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/install.txt" 2>&1 || echo "install FAILED"
t pytest
timeout ${PYTEST_S:-110} python3 -P -m pytest -q -p no:cacheprovider -rs -x tests \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -4 "$OUT/pytest_gpu.txt"
R=/tmp/ficco_results5; rm -rf "$R"; mkdir -p "$R"
t tp_block
timeout ${TP_S:-150} python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=4096 \
  --heads=32 --d_ff=14336 --seq=8192 --schedule=ring:1:dma --variant_timeout_s=70 \
  --rounds=5 --iters=5 > "$R/tp_block.log" 2>&1
echo "tp rc=$?"; tail -8 "$R/tp_block.log"
cp "$R"/tp_block* "$OUT"/ 2>/dev/null
t end
