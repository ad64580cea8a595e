#!/usr/bin/env bash
# Session 10, call C, for the 4-GPU machine (nvidia-h200-x4). ~9 min, with
# async issue made the CUDA default (it now waits for the issue in sync):
#  1. issue 6's ten reduce-scatter shapes, schedule=None under each issue
#     mode and XLA's program through ficco ('none'), interleaved;
#  2. the all-gather op's ten shapes the same way (the issue mode is
#     process-wide, so the default change reaches it too);
#  3. the tensor-parallel block's training step at d 4096 under the new
#     default, ficco vs XLA, and peak memory.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r48"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || { echo "install FAILED"; exit 1; }
# -P: not the source tree (no .so there); the call as run lacked it, so this line failed there.
python3 -P -c "from ficco_jax._src.dma import library as l; print('cuda issue mode:', l.issue_mode('cuda'))"
t rs
timeout 215 python3 benchmarks/stall_watch.py --out="$R/stall_rs.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default@async,default@parallel,none \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=200 --out_dir="$R" --tag=w4_issue6_s10c > "$R/rs.log" 2>&1
echo "rs rc=$?"; [ -f "$R/stall_rs.txt" ] && head -40 "$R/stall_rs.txt"
grep -E "^\|" "$R/rs_w4_issue6_s10c.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_issue6_s10c.json"
t ag
timeout 150 python3 benchmarks/stall_watch.py --out="$R/stall_ag.txt" --stall_s=40 -- \
  benchmarks/ag_bench.py --axis_sizes=4 --peers= \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default@async,default@parallel,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=135 --out_dir="$R" --tag=w4_ag_s10c > "$R/ag.log" 2>&1
echo "ag rc=$?"; [ -f "$R/stall_ag.txt" ] && head -40 "$R/stall_ag.txt"
grep -E "^\|" "$R/ag_w4_ag_s10c.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/ag_w4_ag_s10c.json"
t "tp_block d=4096"
timeout 120 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=4096 --heads=32 \
  --d_ff=14336 --seq=8192 --schedule=default --variant_timeout_s=55 --rounds=5 --iters=5 \
  --tag=gpu_dp1tp4_d4096_s10c > "$R/tp_block_d4096.log" 2>&1
echo "tp rc=$?"; grep -E "^\| (ficco|xla)|speedup|resolves|peak" "$R/tp_block_d4096.log"
ls "$R"
t end
