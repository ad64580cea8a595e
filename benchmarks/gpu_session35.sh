#!/usr/bin/env bash
# Session 7, call B, for the 4-GPU machine (nvidia-h200-x4). ~8 min:
#  1. host_floor.py at 512x4096x4096: the handlers' host time per start and
#     sync on this machine (session 5: 55 us for 3 starts, 30 us per sync),
#     since call A's short shapes read far below session 6's;
#  2. issue 6's ten shapes again under the new harness (a second run, for the
#     spread between runs), with step + pallas at c2 and c4;
#  3. PyTorch's fused_matmul_reduce_scatter on the same shapes (the peer).
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r35"; rm -rf "$R"; mkdir -p "$R"  # straight into $OUT: a cut call still returns its files
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t host_floor
timeout 70 python3 benchmarks/host_floor.py --ops=rs,ag --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma,direct/c1/dma/pallas/step,ring/c1/dma --rounds=7 --iters=50 \
  --stats_calls=200 --out="$R/host_floor_512.json" > "$R/host_floor.log" 2>&1
echo "host_floor rc=$?"; grep -E "^\| (rs|ag)" "$R/host_floor_512.md"
t rs
timeout 280 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,direct/c2/dma/pallas/step,direct/c4/dma/pallas/step,ring/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=260 --out_dir="$R" --tag=w4_issue6_b > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_issue6_b.md" | cut -c1-250
t torch_rs
timeout 130 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
  benchmarks/torch_async_tp.py --ops=rs --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b \
  --tokens=4096,8192 --square=1 --rounds=7 --iters=20 --time_budget_s=110 --out_dir="$R" \
  --tag=w4_rs > "$R/torch_rs.log" 2>&1; echo "torch rc=$?"
grep -E "^\|" "$R"/*torch*.md 2>/dev/null | cut -c1-200 | head -14
t end
