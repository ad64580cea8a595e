#!/usr/bin/env bash
# Short follow-up call: re-run the GPU tests changed after session 3, time
# schedule=None now that the shipped H200 autotune cache resolves, and the
# tensor-parallel block with an explicit copy-engine schedule.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps . > /dev/null 2>&1 || echo "install FAILED"
timeout 40 python3 -P -m pytest -q -p no:cacheprovider -rs \
  tests/test_pallas_chunk_matmul.py tests/test_autotune.py > "$OUT/pytest_gpu_followup.txt" 2>&1
echo "pytest rc=$?"; tail -2 "$OUT/pytest_gpu_followup.txt"
R=/tmp/ficco_results4; rm -rf "$R"; mkdir -p "$R"
timeout 110 python3 benchmarks/ag_bench.py --axis_sizes=4 \
  --cases=8192x8192x28672,16384x8192x8192,4096x8192x8192,2048x8192x8192 \
  --models=llama3-8b --tokens=8192,4096 --square=false --schedules=default \
  --peers= --out_dir="$R" --tag=w4_default --time_budget_s=95 --rounds=5 --iters=10 > "$R/ag.log" 2>&1
echo "ag rc=$?"
timeout 60 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --cases=8192x28672x8192,16384x8192x8192,4096x8192x8192 --models=llama3-8b \
  --tokens=8192 --square=false --schedules=default --out_dir="$R" \
  --tag=w4_default --time_budget_s=50 --rounds=5 --iters=10 > "$R/rs.log" 2>&1
echo "rs rc=$?"
timeout 80 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=4096 \
  --heads=32 --d_ff=14336 --seq=8192 --schedule=ring:1:dma --variant_timeout_s=38 \
  --rounds=3 --iters=5 > "$R/tp_block.log" 2>&1
echo "tp rc=$?"; tail -12 "$R/tp_block.log"
cat "$R"/*.md > "$OUT/summary4.md" 2>/dev/null
tar -czf "$OUT/results4.tar.gz" -C "$R" .
cat "$OUT/summary4.md" | grep -E "^\|" | head -30
