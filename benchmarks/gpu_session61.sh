#!/usr/bin/env bash
# Session 14, call F, for the 4-GPU machine (nvidia-h200-x4). ~7 min.
# As shipped at the end of session 14, on another lease than calls C-E:
#  1. issue 6's ten reduce-scatter shapes, schedule=None and none, 7 rounds;
#  2. the all-gather's shapes, schedule=None and none (first measurement
#     since session 10);
#  3. the TP block at d 4096 (step time and peak memory, ficco and XLA).
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r61"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 220 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=200 --out_dir="$R" --tag=w4_ten_s14f > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s14f.json"
t ag
timeout 150 python3 benchmarks/stall_watch.py --out=/tmp/stall_ag.txt --stall_s=40 -- \
  benchmarks/ag_bench.py --axis_sizes=4 --peers= \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=135 --out_dir="$R" --tag=w4_ag_s14f > "$R/ag.log" 2>&1
echo "ag rc=$?"; head -20 /tmp/stall_ag.txt 2>/dev/null
python3 benchmarks/rs_summary.py "$R/ag_w4_ag_s14f.json"
t "tp_block d=4096"
timeout 120 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=4096 --heads=32 \
  --d_ff=14336 --seq=8192 --schedule=default --variant_timeout_s=55 --rounds=5 --iters=5 \
  --tag=gpu_dp1tp4_d4096_s14f > "$R/tp_block_d4096.log" 2>&1
echo "tp rc=$?"; grep -E "^\| (ficco|xla)|speedup|resolves|peak" "$R/tp_block_d4096.log"
ls "$R"
t end
