#!/usr/bin/env bash
# Session 22, call B, one GPU (nvidia-h200). ~4 min.
# cluster_probe.py: jax's Hopper matmul with and without a 2-CTA cluster
# (TMA multicast) against XLA's dot and ficco's chunk kernel, on per-device
# reduce-scatter sizes of issue 6 where ficco's kernel trails cuBLAS.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r101; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
t probe
timeout 420 python3 benchmarks/cluster_probe.py --out_dir="$R" --tag=h200_s22b \
  > "$R/cluster_probe.log" 2>&1
echo "probe rc=$?"; grep -v "^I1\|^W1" "$R/cluster_probe.log" | tail -12
tar czf "$OUT/r101.tgz" -C /tmp r101; ls -la "$OUT"
t end
