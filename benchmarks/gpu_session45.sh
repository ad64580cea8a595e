#!/usr/bin/env bash
# Session 9, call E, for the 4-GPU machine (nvidia-h200-x4). ~4 min: issue 6's
# ten reduce-scatter shapes as shipped at the end of the session: parallel
# issue the default again, llama3-8b M8192's cache entry refilled
# (direct/c1/dma/pallas); schedule=None, XLA's program through ficco
# ('none'), and direct/c1/dma under async issue, in one interleaved run.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r45"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || { echo "install FAILED"; exit 1; }
t rs
timeout 290 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma@async \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=270 --out_dir="$R" --tag=w4_issue6_s9e > "$R/rs.log" 2>&1
echo "rs rc=$?"; [ -f "$R/stall.txt" ] && head -40 "$R/stall.txt"
grep -E "^\|" "$R/rs_w4_issue6_s9e.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_issue6_s9e.json"
ls "$R"
t end
