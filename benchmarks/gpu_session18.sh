#!/usr/bin/env bash
# Session 4, call A on the 4-GPU machine (~6 min): the reduce-scatter after
# ficco_peer_copy_sync (one FFI call waits for every pulled partial and ends
# every invocation: direct/c1 goes from 9 FFI calls per op to 4, ring/c1
# from 9 to 7).
#  1. the copy-engine tests on the GPUs (protocol, HLO, both ops, gradients);
#  2. the interleaved reduce-scatter sweep of the benchmark shapes plus the
#     host-bound 512x4096x4096 (issue 6's table and issue 5's labels).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results18; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 90 python3 -P -m pytest -q -p no:cacheprovider tests/test_dma_protocol.py -k cuda \
  > "$R/pytest_protocol_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_protocol_gpu.txt"
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_hlo.py tests/test_ops.py \
  tests/test_grad.py -k "hlo or reduce_scatter or rs or grad" > "$R/pytest_rs_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_rs_gpu.txt"
t rs
timeout 300 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --cases=512x4096x4096 \
  --schedules=default,none,direct/c1/dma,direct/c2/dma,ring/c1/dma,bidirectional/c1/dma \
  --interleave --rounds=7 --iters=20 --time_budget_s=280 --out_dir="$R" --tag=w4_sync \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t end
tar -czf "$OUT/results18.tar.gz" -C "$R" .
cat "$R"/*.md | grep -E "^\|" | cut -c1-250 | head -40
