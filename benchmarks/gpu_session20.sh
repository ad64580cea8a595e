#!/usr/bin/env bash
# Session 4, call C on the 4-GPU machine (~4 min): the reduce-scatter with
# compute="pallas", whose kernel now TMA-loads each piece's rows of h0 in
# place (chunk_matmul_rows: no slice copy, no zero fill), against the same
# schedules with XLA's dot, interleaved on the benchmark shapes.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results20; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_ops.py -k "pallas or reduce_scatter" \
  > "$R/pytest_pallas_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_pallas_gpu.txt"
t rs
timeout 330 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=none,direct/c1/dma,ring/c1/dma,direct/c1/dma/pallas,ring/c1/dma/pallas,direct/c2/dma/pallas \
  --interleave --rounds=7 --iters=20 --time_budget_s=300 --out_dir="$R" --tag=w4_pallas \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t end
tar -czf "$OUT/results20.tar.gz" -C "$R" .
cat "$R"/*.md | grep -E "^\|" | cut -c1-250 | head -40
