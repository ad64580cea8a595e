#!/usr/bin/env bash
# Session 3, call D on the 4-GPU machine (~7.5 min):
#  1. who issues the copies (FICCO_CUDA_ISSUE=last: the last rank to arrive,
#     so no host thread waits for its peers in start; default: each rank
#     its own, after a host rendezvous), on short and long ops of both kinds;
#  2. PyTorch's fused_matmul_reduce_scatter on the reduce-scatter cases of
#     call A (same harness, torchrun);
#  3. an interleaved all-gather schedule sweep (issue 5's labels).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results14; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
for mode in parallel last; do
  t "issue=$mode rs"
  FICCO_CUDA_ISSUE=$mode timeout 62 python3 benchmarks/rs_bench.py --axis_sizes=4 --models= \
    --square=true --cases=512x4096x4096,8192x14336x4096 --schedules=none,direct/c1/dma,ring/c1/dma \
    --interleave --rounds=7 --iters=20 --time_budget_s=52 --out_dir="$R" --tag=w4_issue_$mode \
    > "$R/rs_issue_$mode.log" 2>&1; echo "rc=$?"
  t "issue=$mode ag"
  FICCO_CUDA_ISSUE=$mode timeout 48 python3 benchmarks/ag_bench.py --axis_sizes=4 --models= \
    --square=false --cases=2048x8192x8192,4096x8192x8192,16384x8192x8192 --schedules=none,ring/c1/dma \
    --peers= --interleave --rounds=7 --iters=20 --time_budget_s=40 --out_dir="$R" --tag=w4_issue_$mode \
    > "$R/ag_issue_$mode.log" 2>&1; echo "rc=$?"
done
t torch_rs
timeout 135 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
  benchmarks/torch_async_tp.py --ops=rs --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b \
  --tokens=4096,8192 --square=1 --rounds=7 --iters=20 --time_budget_s=110 --out_dir="$R" \
  --tag=w4_rs > "$R/torch_rs.log" 2>&1; echo "torch rc=$?"
t ag_sweep
timeout 150 python3 benchmarks/ag_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --cases=2048x8192x8192 \
  --schedules=default,none,direct/c1/dma,direct/c2/dma,ring/c1/dma,ring/c2/dma,bidirectional/c1/dma \
  --peers= --interleave --rounds=5 --iters=20 --time_budget_s=140 --out_dir="$R" --tag=w4_sweep \
  > "$R/ag_sweep.log" 2>&1; echo "ag_sweep rc=$?"
t end
tar -czf "$OUT/results14.tar.gz" -C "$R" .
for f in "$R"/*issue*.md "$R"/torch*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-260; done
