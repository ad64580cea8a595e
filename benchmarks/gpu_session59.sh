#!/usr/bin/env bash
# Session 14, call D, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# Issue 6's ten shapes with the lock-free host waits (call C's change):
# schedule=None, none, piece c1 and halving c1, interleaved, 5 rounds.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r59"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 340 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma/pallas,direct/c1/dma/pallas/halving \
  --interleave --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=300 --out_dir="$R" --tag=w4_ten_s14d > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s14d.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s14d.json"
ls "$R"
t end
