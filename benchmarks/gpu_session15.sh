#!/usr/bin/env bash
# Session 3, call E on the 4-GPU machine (~8 min): more labels for issue 5.
# Both ops, every model of shapes.json at M = 2048 and 16384 (calls A and D
# measured M = 4096 and 8192), the schedule families, interleaved
# round-robin per case (timing.interleaved), 7 rounds of 20 calls.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results15; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t rs
timeout 270 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=2048,16384 --square=false \
  --schedules=default,none,direct/c1/dma,direct/c2/dma,ring/c1/dma,bidirectional/c1/dma \
  --interleave --rounds=7 --iters=20 --time_budget_s=235 --out_dir="$R" --tag=w4_sweep2 \
  > "$R/rs.log" 2>&1; echo "rs rc=$?"
t ag
timeout 270 python3 benchmarks/ag_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=2048,16384 --square=false \
  --schedules=default,none,direct/c1/dma,direct/c2/dma,ring/c1/dma,ring/c2/dma,bidirectional/c1/dma \
  --peers= --interleave --rounds=7 --iters=20 --time_budget_s=235 --out_dir="$R" --tag=w4_sweep2 \
  > "$R/ag.log" 2>&1; echo "ag rc=$?"
t end
tar -czf "$OUT/results15.tar.gz" -C "$R" .
for f in "$R"/*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-200; done
