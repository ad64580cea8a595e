#!/usr/bin/env bash
# Session 4, call D on the 4-GPU machine (~7 min): the reduce-scatter sweep
# the autotune cache is refilled from, now with compute="pallas" (rows read
# in place; K = 7392 of qwen2-72b takes half-depth pipeline steps), and
# PyTorch's fused_matmul_reduce_scatter on the same shapes in the same call.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results21; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_pallas_chunk_matmul.py \
  -k "pallas or reduce_scatter or config" > "$R/pytest_pallas_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_pallas_gpu.txt"
t rs
timeout 300 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,ring/c1/dma,direct/c2/dma,direct/c1/dma/pallas,ring/c1/dma/pallas,direct/c2/dma/pallas \
  --interleave --rounds=7 --iters=20 --time_budget_s=280 --out_dir="$R" --tag=w4_sweep \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t torch_rs
timeout 135 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
  benchmarks/torch_async_tp.py --ops=rs --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b \
  --tokens=4096,8192 --square=1 --rounds=7 --iters=20 --time_budget_s=110 --out_dir="$R" \
  --tag=w4_rs > "$R/torch_rs.log" 2>&1; echo "torch rc=$?"
t end
tar -czf "$OUT/results21.tar.gz" -C "$R" .
for f in "$R"/*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-250; done
