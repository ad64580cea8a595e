#!/usr/bin/env bash
# Session 5, call E on the 4-GPU machine (~4 min): issue 6's reduce-scatter
# table with schedule=None after the autotune cache was refilled from this
# session's sweeps (calls B and C, and call C's M = 2048 labels).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results28; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t rs
timeout 230 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma/pallas,ring/c1/dma \
  --interleave --rounds=7 --iters=20 --time_budget_s=210 --out_dir="$R" --tag=w4_default \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t end
tar -czf "$OUT/results28.tar.gz" -C "$R" .
for f in "$R"/*default*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-250; done
