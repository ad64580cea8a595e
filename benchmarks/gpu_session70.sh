#!/usr/bin/env bash
# Session 17, call A, for the 4-GPU machine (nvidia-h200-x4). ~8 min.
# Issue 6's confirmation on a machine other than session 16's: the ten
# shapes as shipped (schedule=None, the cache) and piece c1, interleaved in
# one process (the same command as gpu_session69.sh), then PyTorch's
# fused_matmul_reduce_scatter on the same shapes in the same lease, so the
# peer's ratio is read against an XLA baseline from the same machine.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r70; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)"
install_ficco
t rs
timeout 300 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,direct/c1/dma/pallas \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=250 --out_dir="$R" --tag=w4_ten_s17a > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s17a.json"
t torch_rs
timeout 140 python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
  benchmarks/torch_async_tp.py --ops=rs --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b \
  --tokens=4096,8192 --square=1 --rounds=7 --iters=20 --time_budget_s=110 --out_dir="$R" \
  --tag=w4_rs_s17a > "$R/torch_rs.log" 2>&1; echo "torch rc=$?"
grep -E "^\|" "$R"/*torch*.md 2>/dev/null | cut -c1-220 | head -14
tar czf "$OUT/r70.tgz" -C /tmp r70; ls -la "$OUT"
t end
