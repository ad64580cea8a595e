#!/usr/bin/env bash
# Session 10, call B, for the 4-GPU machine (nvidia-h200-x4). ~6 min: the six
# long reduce-scatter shapes of issue 6 (llama3-70b, qwen2-72b, gpt3-175b at
# M 4096 and 8192), the cache's picks under each issue mode and the main
# schedules under async, watched by stall_watch.py.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r47"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || { echo "install FAILED"; exit 1; }
t rs
timeout 330 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=false \
  --schedules=default@parallel,default@async,none,direct/c1/dma@async,direct/c1/dma/pallas@async,direct/c2/dma/pallas/step@async,direct/c2/dma@async \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=300 --out_dir="$R" --tag=w4_long_s10b > "$R/rs.log" 2>&1
echo "rs rc=$?"; [ -f "$R/stall.txt" ] && head -40 "$R/stall.txt"
grep -E "^\|" "$R/rs_w4_long_s10b.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_long_s10b.json"
ls "$R"
t end
