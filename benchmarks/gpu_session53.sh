#!/usr/bin/env bash
# Session 13, call A, for the 4-GPU machine (nvidia-h200-x4). ~4 min.
# Where the host-bound reduce-scatter's time goes (issue 6's two short
# shapes sit on ficco's host floor, ~0.27 ms per call against XLA's 0.16):
#  1. host floor at 512x4096x4096: XLA, a trivial 4-device program, and four
#     ficco schedules (copy engines or XLA's ppermute; pieces or one step);
#  2. profiles with the last call's host timeline (every XLA execute
#     thread's thunks, nested): XLA and direct/c1/dma/pallas at 512x4096x4096
#     and at llama3-8b M4096.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r53"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t floor
timeout 150 python3 benchmarks/host_floor.py --ops=rs --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma/pallas,direct/c1/xla/pallas,direct/c1/dma/pallas/step,direct/c2/dma/pallas \
  --rounds=7 --iters=50 --out="$R/host_floor_512.json" > /tmp/floor.log 2>&1
echo "floor rc=$?"; cat "$R/host_floor_512.md" 2>/dev/null || tail -20 /tmp/floor.log
t profile
timeout 150 python3 benchmarks/profile_ops.py --calls=10 --host_timeline --out_dir="$R" \
  --specs=rs:512x4096x4096:xla,rs:512x4096x4096:direct/c1/dma/pallas,rs:4096x14336x4096:direct/c1/dma/pallas \
  > /tmp/prof.log 2>&1
echo "profile rc=$?"; grep -E "^#|compute stream idle|total" /tmp/prof.log | cut -c1-300
ls "$R"
t end
