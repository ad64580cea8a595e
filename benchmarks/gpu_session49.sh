#!/usr/bin/env bash
# Session 11, call A, for the 4-GPU machine (nvidia-h200-x4). ~9 min.
#  1. the peer-copy protocol and the ops' copy-engine tests on the GPUs
#     (first GPU run of cc6cc08's SetIssueMode<Backend>); stops if they fail;
#  2. profiles (JAX profiler, 10 calls) of the GPU-bound reduce-scatter
#     under each CUDA issue mode: where do the long shapes lose against their
#     ideal, and why parallel issue led async by 1-4% in session 10;
#  3. the hardware-queue question: three long shapes, default@async and
#     default@parallel, in one process with CUDA_DEVICE_MAX_CONNECTIONS=32
#     and one with the driver's default (8).
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r49"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t pytest
timeout 120 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_dma_protocol.py tests/test_ops.py -k "cuda or dma or async" \
  > "$R/pytest_dma_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -1 "$R/pytest_dma_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" "$R/pytest_dma_gpu.txt" | head -30; exit 1; fi
t profile_async
SQ=rs:16384x8192x8192; L70=rs:4096x28672x8192
timeout 110 python3 benchmarks/profile_ops.py --out_dir=/tmp/prof_a \
  --specs=$SQ:xla,$SQ:direct/c1/dma/pallas,$SQ:direct/c2/dma/pallas,$L70:xla,$L70:direct/c1/dma/pallas \
  > "$R/profile_async.txt" 2>&1
echo "profile rc=$?"
t profile_parallel
FICCO_CUDA_ISSUE=parallel timeout 70 python3 benchmarks/profile_ops.py --out_dir=/tmp/prof_p \
  --specs=$SQ:direct/c1/dma/pallas,$L70:direct/c1/dma/pallas \
  > "$R/profile_parallel.txt" 2>&1
echo "profile rc=$?"
for conn in 32 default; do
  t "rs conn=$conn"
  if [ $conn = default ]; then unset CUDA_DEVICE_MAX_CONNECTIONS; else export CUDA_DEVICE_MAX_CONNECTIONS=$conn; fi
  timeout 115 python3 benchmarks/rs_bench.py --axis_sizes=4 \
    --models=llama3-70b,qwen2-72b,gpt3-175b --tokens=4096 --square=false \
    --schedules=default@parallel,default@async,none \
    --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
    --time_budget_s=95 --out_dir="$R" --tag=w4_conn_$conn > /tmp/rs_$conn.log 2>&1
  echo "rs rc=$?"; tail -3 /tmp/rs_$conn.log
  python3 benchmarks/rs_summary.py "$R/rs_w4_conn_$conn.json"
done
unset CUDA_DEVICE_MAX_CONNECTIONS
ls "$R"
t end
