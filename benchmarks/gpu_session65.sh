#!/usr/bin/env bash
# Session 15, call D, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# The two host-bound reduce-scatter shapes (llama3-8b M4096, square 4096)
# under every granularity of the direct schedule, to pick the one whose
# worst machine is best: call C read llama3-8b M4096 at 0.68x with its
# cache entry (piece, direct/c1/dma/pallas). Two processes, 9 rounds each,
# interleaved; plus host_timeline.py's trivial program as the host's speed.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r65; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
for run in 1 2; do
  t "rs run $run"
  timeout 140 python3 benchmarks/stall_watch.py --out="$R/stall$run.txt" --stall_s=40 -- \
    benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-8b --tokens=4096 --square=false \
    --cases=4096x8192x8192 \
    --schedules=default,none,direct/c1/dma/pallas/halving,direct/c1/dma/pallas/step,direct/c2/dma/pallas/step,direct/c1/dma/xla \
    --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
    --time_budget_s=125 --out_dir="$R" --tag=w4_host_s15d_$run > "$R/rs$run.log" 2>&1
  echo "rc=$?"; python3 benchmarks/rs_summary.py "$R/rs_w4_host_s15d_$run.json"
done
t timeline
timeout 100 python3 benchmarks/host_timeline.py --schedules=default --warmup=3 --rounds=8 \
  --iters=80 --m=4096 --k=14336 --n=4096 --out="$R/tl_l8.json" > "$R/tl_l8.log" 2>&1
echo "rc=$?"; grep -E "^median|^ficco rounds" "$R/tl_l8.log"
tar czf "$OUT/r65.tgz" -C /tmp r65; ls -la "$OUT"
t end
