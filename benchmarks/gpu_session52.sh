#!/usr/bin/env bash
# Session 12, call B, for the 4-GPU machine (nvidia-h200-x4). ~7 min.
# Issue 6's ten reduce-scatter shapes: schedule=None, XLA's program
# (`none`), and the Pallas direct schedules at one chunk, interleaved, so
# that the cache's `none` for llama3-8b M4096 (chosen before ByRank removed
# the per-launch offset kernels) is re-measured against them in one run.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r52"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 480 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma/pallas,direct/c1/dma/pallas/step \
  --interleave --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=420 --out_dir="$R" --tag=w4_ten_s12b > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s12b.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s12b.json"
ls "$R"
t end
