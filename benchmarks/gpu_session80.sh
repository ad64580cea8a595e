#!/usr/bin/env bash
# Session 18, call D, for the 4-GPU machine (nvidia-h200-x4). ~3 min.
# Issue 6's ten shapes as shipped (schedule=None) with piece c1 beside it,
# with the session-18 cache (square 4096: flagged), on a fresh machine.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r80; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 200 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,direct/c1/dma/pallas \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=170 --out_dir="$R" --tag=w4_ten_s18d > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s18d.json"
tar czf "$OUT/r80.tgz" -C /tmp r80; ls -la "$OUT"
t end
