#!/usr/bin/env bash
# Session 13, call C, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# The cache now answers direct/c1/dma/pallas/halving for llama3-8b M4096.
#  1. profiles of square 4096: halving against piece (call B measured
#     halving 1.03x there against piece's 1.50x; where does it lose?);
#  2. issue 6's ten shapes as shipped (schedule=None), interleaved with
#     none, piece c1 and halving c1, under stall_watch.py.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r55"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t profile
timeout 120 python3 benchmarks/profile_ops.py --calls=10 --out_dir="$R" \
  --specs=rs:4096x8192x8192:direct/c1/dma/pallas/halving,rs:4096x8192x8192:direct/c1/dma/pallas \
  > /tmp/prof.log 2>&1
echo "profile rc=$?"; grep -E "^#|stream|copies|idle|timeline|Memcpy|mosaic" "$R/profile_0.txt" | head -40 | cut -c1-220
t rs
timeout 330 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma/pallas,direct/c1/dma/pallas/halving \
  --interleave --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=290 --out_dir="$R" --tag=w4_ten_s13c > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s13c.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s13c.json"
ls "$R"
t end
