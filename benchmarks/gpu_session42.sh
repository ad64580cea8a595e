#!/usr/bin/env bash
# Session 9, call B, for the 4-GPU machine (nvidia-h200-x4). ~6 min: issue 6's
# ten reduce-scatter shapes with the schedules of session 8 call D, now under
# async issue (the CUDA default since call A), plus direct/c1/dma under the
# parallel issue it replaced, in the same interleaved run.
set -u
source "$(dirname "$0")/gpu_env.sh"
# Async issue was the CUDA default when this call ran (parallel is again
# since call E); set here so a re-run measures the same thing.
export FICCO_CUDA_ISSUE=async
R="$OUT/r42"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || { echo "install FAILED"; exit 1; }
t rs
timeout 330 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma@parallel,direct/c1/dma/pallas,direct/c2/dma/pallas/step,ring/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=310 --out_dir="$R" --tag=w4_issue6_s9b > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_issue6_s9b.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_issue6_s9b.json"
ls "$R"
t end
