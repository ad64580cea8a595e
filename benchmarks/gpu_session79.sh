#!/usr/bin/env bash
# Session 18, call C, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# The issue mode on the host-sensitive shapes: does the XLA thread issuing
# its own pulls (parallel) shorten the host period of the flagged and piece
# schedules against the issuer threads (async, the default)? Host floor at
# 512x4096x4096 with the handlers' counters, then llama3-8b M4096/M8192 and
# the two squares, interleaved.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r79; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t host_floor
timeout 150 python3 benchmarks/host_floor.py --ops=rs --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma/pallas/flagged@async,direct/c1/dma/pallas/flagged@parallel,direct/c1/dma/pallas@async,direct/c1/dma/pallas@parallel,direct/c1/dma/pallas/step@async \
  --rounds=9 --iters=50 --min_round_ms=25 --out="$R/host_floor_512.json" > "$R/host_floor.log" 2>&1
echo "host_floor rc=$?"; tail -15 "$R/host_floor.log"
t rs
timeout 260 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-8b --tokens=4096,8192 --square=true \
  --schedules=default,direct/c1/dma/pallas/flagged@async,direct/c1/dma/pallas/flagged@parallel,direct/c1/dma/pallas@async,direct/c1/dma/pallas@parallel \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=240 --out_dir="$R" --tag=w4_modes_s18c > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_modes_s18c.json"
tar czf "$OUT/r79.tgz" -C /tmp r79; ls -la "$OUT"
t end
