#!/usr/bin/env bash
# Session 5, call B on the 4-GPU machine (~8 min): issue 6's reduce-scatter
# table on this session's protocol (sync waits only for the newest copy per
# queue of those reading this rank's buffers; per-thread memos of side
# streams and peer access), with PyTorch's fused reduce-scatter in the same
# call, and the host floor with each way of enqueueing a copy
# (cudaMemcpyPeerAsync, the default, vs cudaMemcpyAsync: FICCO_CUDA_MEMCPY).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results25; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_dma_protocol.py -k cuda \
  > "$R/pytest_protocol_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_protocol_gpu.txt"
for mode in peer default; do
  t "host_floor memcpy=$mode"
  FICCO_CUDA_MEMCPY=$mode timeout 100 python3 benchmarks/host_floor.py --ops=rs,ag \
    --m=512 --k=4096 --n=4096 --schedules=direct/c1/dma,ring/c1/dma --rounds=7 --iters=50 \
    --stats_calls=200 --out="$R/host_floor_512_$mode.json" > "$R/host_floor_$mode.log" 2>&1
  echo "host_floor rc=$?"; grep -E "^\| (rs|ag)" "$R/host_floor_512_$mode.md"
done
t rs
timeout 300 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,ring/c1/dma,ring/c1/dma/pallas,direct/c2/dma/pallas \
  --interleave --rounds=7 --iters=20 --time_budget_s=280 --out_dir="$R" --tag=w4_sweep \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t torch_rs
timeout 135 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
  benchmarks/torch_async_tp.py --ops=rs --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b \
  --tokens=4096,8192 --square=1 --rounds=7 --iters=20 --time_budget_s=110 --out_dir="$R" \
  --tag=w4_rs > "$R/torch_rs.log" 2>&1; echo "torch rc=$?"
t end
tar -czf "$OUT/results25.tar.gz" -C "$R" .
for f in "$R"/*sweep*.md "$R"/*torch*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-250; done
