#!/usr/bin/env bash
# Session 18, call A, for the 4-GPU machine (nvidia-h200-x4). ~8 min.
# The host-bound reduce-scatter (llama3-8b M4096; square 4096 beside it):
# per call by transport (rendezvous / window) and granularity, and 8 ops
# chained in one program (host_bound_probe.py); then ficco_jax.autotune with
# its default candidates (interleaved rounds) at llama3-8b M4096.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r77; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
nproc; grep -m1 "model name" /proc/cpuinfo
install_ficco
t probe
timeout 260 python3 benchmarks/stall_watch.py --out="$R/stall_probe.txt" --stall_s=40 -- \
  benchmarks/host_bound_probe.py --cases=4096x14336x4096,4096x8192x8192 \
  --schedules=default,direct/c1/dma/pallas/flagged,direct/c1/dma/pallas,direct/c1/dma/pallas#window,direct/c1/dma/pallas/step,direct/c1/dma/pallas/step#window,none \
  --chain=8 --chain_schedules=default,direct/c1/dma/pallas#window \
  --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --out_dir="$R" --tag=s18a > "$R/probe.log" 2>&1
echo "probe rc=$?"; tail -40 "$R/probe.log"
t autotune
timeout 230 python3 benchmarks/stall_watch.py --out="$R/stall_at.txt" --stall_s=60 -- \
  benchmarks/host_bound_probe.py --cases=4096x14336x4096 --schedules= --chain=0 \
  --autotune --autotune_rounds=5 --autotune_iters=20 \
  --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --out_dir="$R" --tag=s18a_autotune > "$R/autotune.log" 2>&1
echo "autotune rc=$?"; tail -70 "$R/autotune.log"
tar czf "$OUT/r77.tgz" -C /tmp r77; ls -la "$OUT"
t end
