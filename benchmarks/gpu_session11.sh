#!/usr/bin/env bash
# Session 3, call A on the 4-GPU machine (~9 min): the reduce-scatter with
# the pipelined direct dataflow (each partial pulled by its owner as soon as
# it is multiplied). GPU tests of the reduce-scatter; then every schedule
# family against XLA, interleaved round-robin per case, on the benchmark
# shapes plus a tiny case that shows the per-call floor; the same direct
# schedule through the window transport in one process.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results11; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 100 python3 -P -m pytest -q -p no:cacheprovider -x tests/test_ops.py tests/test_grad.py \
  -k "reduce_scatter or rs or grad" > "$R/pytest_rs_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_rs_gpu.txt"
t rs
timeout 300 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --cases=512x4096x4096 \
  --schedules=default,none,direct/c1/dma,direct/c2/dma,ring/c1/dma,bidirectional/c1/dma \
  --interleave --rounds=7 --iters=20 --time_budget_s=280 --out_dir="$R" --tag=w4_direct \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t rs_window
FICCO_DMA_TRANSPORT=window timeout 80 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b --tokens=8192 --square=true --cases=512x4096x4096 \
  --schedules=none,direct/c1/dma,ring/c1/dma --interleave --rounds=7 --iters=20 \
  --time_budget_s=70 --out_dir="$R" --tag=w4_direct_window > "$R/rs_window.log" 2>&1
echo "rs_window rc=$?"
t end
tar -czf "$OUT/results11.tar.gz" -C "$R" .
cat "$R"/*.md | grep -E "^\|" | head -40
