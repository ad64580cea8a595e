#!/usr/bin/env bash
# Session 14, call E, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# Issue 6's ten shapes as shipped after the lock-free host waits and
# llama3-8b M4096's cache entry back to direct/c1/dma/pallas:
# schedule=None and XLA's program through ficco (none), interleaved,
# 7 rounds (meant for a fresh lease; session 14 got call D's machine).
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r60"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 330 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=290 --out_dir="$R" --tag=w4_ten_s14e > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s14e.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s14e.json"
ls "$R"
t end
