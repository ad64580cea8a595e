#!/usr/bin/env bash
# Session 2, call C on the 4-GPU machine (~6 min): the held-out regime for
# the heuristic's accuracy (issue 5: gpt3-175b and M=4096, never in the fit
# data, plus fit-split cases timed again), and the tensor-parallel block at
# llama3-70b width with the library's default schedules (issue 6).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results7; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t ag_acc
timeout 120 python3 benchmarks/ag_bench.py --axis_sizes=4 --models=gpt3-175b,llama3-8b,llama3-70b \
  --tokens=4096,8192 --square=false --cases=4096x8192x8192,2048x8192x8192 \
  --schedules=default,ring/c1/dma,bidirectional/c1/dma,direct/c1/dma,ring/c2/dma,direct/c2/dma \
  --peers= --rounds=5 --iters=20 --time_budget_s=100 --out_dir="$R" --tag=w4_acc > "$R/ag_acc.log" 2>&1
echo "ag rc=$?"
t rs_acc
timeout 95 python3 benchmarks/rs_bench.py --axis_sizes=4 --models=gpt3-175b,llama3-8b,llama3-70b \
  --tokens=4096,8192 --square=false --cases=4096x8192x8192 \
  --schedules=default,ring/c1/dma,bidirectional/c1/dma,direct/c1/dma,direct/c2/dma --comms=dma \
  --rounds=5 --iters=20 --time_budget_s=80 --out_dir="$R" --tag=w4_acc > "$R/rs_acc.log" 2>&1
echo "rs rc=$?"
t tp_block
timeout 150 python3 benchmarks/tp_block_bench.py --out_dir="$R" --d_model=8192 --heads=64 \
  --d_ff=28672 --seq=8192 --schedule=default --variant_timeout_s=70 --rounds=5 --iters=5 \
  > "$R/tp_block.log" 2>&1
echo "tp rc=$?"; tail -8 "$R/tp_block.log"
t end
tar -czf "$OUT/results7.tar.gz" -C "$R" .
cp "$R"/*.md "$OUT"/ 2>/dev/null
cat "$R"/*.md | grep -E "^\|" | head -60
