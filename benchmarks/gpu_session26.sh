#!/usr/bin/env bash
# Session 5, call C on the 4-GPU machine (~9 min): copies now enqueued with
# cudaMemcpyAsync (cudaMemcpyDefault) instead of cudaMemcpyPeerAsync (~5 us
# less host time each, call B).
#  1. the copy-engine tests on the GPUs with it;
#  2. the host floor;
#  3. issue 6's reduce-scatter table (schedule=None and the candidates);
#  4. issue 5's labels at M = 2048, both ops, every model, 15 rounds (the
#     host-bound end, where the host cost per copy moves the picks).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results26; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 60 python3 -P -m pytest -q -p no:cacheprovider tests/test_dma_protocol.py -k cuda \
  > "$R/pytest_protocol_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_protocol_gpu.txt"
timeout 80 python3 -P -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_grad.py \
  -k "dma" > "$R/pytest_ops_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_ops_gpu.txt"
t host_floor
timeout 60 python3 benchmarks/host_floor.py --ops=rs,ag --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma,ring/c1/dma --rounds=7 --iters=50 --stats_calls=200 \
  --out="$R/host_floor_512.json" > "$R/host_floor.log" 2>&1
echo "host_floor rc=$?"; grep -E "^\| (rs|ag)" "$R/host_floor_512.md"
t rs
timeout 215 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,ring/c1/dma \
  --interleave --rounds=7 --iters=20 --time_budget_s=195 --out_dir="$R" --tag=w4_sweep \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t "labels M=2048"
timeout 110 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=2048 --square=false \
  --schedules=none,direct/c1/dma,direct/c2/dma,ring/c1/dma,bidirectional/c1/dma \
  --interleave --rounds=15 --iters=20 --time_budget_s=95 --out_dir="$R" --tag=w4_sweep_m2048 \
  > "$R/rs_m2048.log" 2>&1; echo "rs rc=$?"
timeout 110 python3 benchmarks/ag_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=2048 --square=false \
  --schedules=none,direct/c1/dma,direct/c2/dma,ring/c1/dma,ring/c2/dma,bidirectional/c1/dma \
  --peers= --interleave --rounds=15 --iters=20 --time_budget_s=95 --out_dir="$R" --tag=w4_sweep_m2048 \
  > "$R/ag_m2048.log" 2>&1; echo "ag rc=$?"
t end
tar -czf "$OUT/results26.tar.gz" -C "$R" .
for f in "$R"/*sweep*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-250; done
