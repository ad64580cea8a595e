#!/usr/bin/env bash
# Session 2, call D on the 4-GPU machine (~4 min): reduce-scatter after the
# direct-dataflow ordering fix (the last chunk's own-rows matmul is now tied
# to its start), and more copy-engine schedules in the 4-process layout.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results8; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > /dev/null 2>&1 || echo "install FAILED"
t rs
timeout 150 python3 benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-70b,llama3-8b \
  --tokens=8192 --square=false --cases=8192x28672x8192,16384x8192x8192,4096x8192x8192 \
  --schedules=default,direct/c1/dma,direct/c2/dma,ring/c1/dma,bidirectional/c1/dma --comms=dma \
  --rounds=5 --iters=20 --time_budget_s=130 --out_dir="$R" --tag=w4_rsfix > "$R/rs_rsfix.log" 2>&1
echo "rs rc=$?"
t mp4x1
timeout 90 python3 -m ficco_jax.launch -n 4 --timeout_s=85 benchmarks/mp_ag_bench.py \
  --out_dir="$R" --tag=mp_4x1_more --schedules=ring:1:dma,bidirectional:1:dma,ring:2:dma,direct:2:dma \
  > "$R/mp_4x1_more.log" 2>&1
echo "mp rc=$?"
t end
tar -czf "$OUT/results8.tar.gz" -C "$R" .
cat "$R"/*.md | grep -E "^\|" | head -40
