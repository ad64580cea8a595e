#!/usr/bin/env bash
# Session 9, call D, for the 4-GPU machine (nvidia-h200-x4). ~6 min. Call C
# (gpu_session43.sh, async issue then the default) stalled on the first call
# of ring/c1/dma at llama3-8b M8192, after five other programs. This call
# runs call C's sequence again under async issue (now opt-in), watched by
# stall_watch.py, which writes every copy queue's flag state and the
# threads' stacks to stall.txt if the ops stall.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r44"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || { echo "install FAILED"; exit 1; }
for pass in 1 2; do
  t "rs pass $pass"
  FICCO_CUDA_ISSUE=async timeout 200 python3 benchmarks/stall_watch.py --out="$R/stall_$pass.txt" --stall_s=40 -- \
    benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-8b --tokens=4096,8192 --square=false \
    --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,direct/c2/dma/pallas/step,ring/c1/dma \
    --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
    --time_budget_s=180 --out_dir="$R" --tag=w4_async_s9d_$pass > "$R/rs_$pass.log" 2>&1
  rc=$?; echo "rs pass $pass rc=$rc"
  [ -f "$R/stall_$pass.txt" ] && head -40 "$R/stall_$pass.txt"
  grep -E "^\| llama" "$R/rs_w4_async_s9d_$pass.md" 2>/dev/null | cut -c1-250
done
ls "$R"
t end
