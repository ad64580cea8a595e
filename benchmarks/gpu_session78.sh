#!/usr/bin/env bash
# Session 18, call B, for the 4-GPU machine (nvidia-h200-x4). ~8 min.
# Issue 6's ten shapes, interleaved per shape: XLA, the trivial program and
# ficco as shipped (schedule=None) per call (the standard harness), and 8
# ops chained in one program for XLA and ficco (host_bound_probe.py): the
# per-op time once Python's per-call dispatch is spread over 8 ops.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r78; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t probe
CASES=llama3-8b/M4096:4096x14336x4096,llama3-8b/M8192:8192x14336x4096,llama3-70b/M4096:4096x28672x8192,llama3-70b/M8192:8192x28672x8192,qwen2-72b/M4096:4096x29568x8192,qwen2-72b/M8192:8192x29568x8192,gpt3-175b/M4096:4096x49152x12288,gpt3-175b/M8192:8192x49152x12288,square/4096:4096x8192x8192,square/16384:16384x8192x8192
timeout 480 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=60 -- \
  benchmarks/host_bound_probe.py --cases=$CASES --schedules=default \
  --chain=8 --chain_schedules=default \
  --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --out_dir="$R" --tag=s18b_ten > "$R/probe.log" 2>&1
echo "probe rc=$?"
python3 benchmarks/host_bound_probe_summary.py "$R/host_bound_s18b_ten.json" || tail -60 "$R/probe.log"
tar czf "$OUT/r78.tgz" -C /tmp r78; ls -la "$OUT"
t end
