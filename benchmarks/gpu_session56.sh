#!/usr/bin/env bash
# Session 13, call D, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# A second measurement of issue 6's ten shapes as shipped (schedule=None,
# with llama3-8b M4096's new cache entry), on a fresh lease: schedule=None
# and XLA's program through ficco (none), interleaved, 7 rounds.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r56"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 330 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=290 --out_dir="$R" --tag=w4_ten_s13d > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s13d.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s13d.json"
ls "$R"
t end
