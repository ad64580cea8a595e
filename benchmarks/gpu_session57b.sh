#!/usr/bin/env bash
# Session 14, call B, for the 4-GPU machine (nvidia-h200-x4). ~1 min.
# copy_probe again with each shift alone and more one-stream orders, to
# tell a slow shift from a slow stream order (call A's "1;2 pull").
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r57b"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
nvidia-smi topo -m | tee "$R/topo.txt"
t build; nvcc -O2 -std=c++17 -o /tmp/copy_probe xla_ffi/tools/copy_probe.cu || exit 1
for mib in 16 64; do
  t "bw $mib"; timeout 60 /tmp/copy_probe bw $mib | tee "$R/copy_probe_bw_${mib}.md"
done
t "bw 16 again"; timeout 60 /tmp/copy_probe bw 16 | tee "$R/copy_probe_bw_16_again.md"
t end
