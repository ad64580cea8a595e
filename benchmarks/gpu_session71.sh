#!/usr/bin/env bash
# Session 17, call B, one GPU (nvidia-h200). ~5 min.
# The flagged kernel alone (flag_kernel_bench.py): session 16's walk and
# per-tile store wait against the piece-ordered walk and the boundary bump,
# with W launches of one piece (piece c1's compute) and XLA's dot, on issue
# 6's ten per-device shapes; every flagged variant's flags checked.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r71; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
t kernels
timeout 420 python3 benchmarks/flag_kernel_bench.py --out_dir="$R" --tag=h200_s17b > "$R/flag_kernel.log" 2>&1
echo "bench rc=$?"; grep -v "^I1\|^W1" "$R/flag_kernel.log" | tail -25
tar czf "$OUT/r71.tgz" -C /tmp r71; ls -la "$OUT"
t end
