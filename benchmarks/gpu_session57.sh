#!/usr/bin/env bash
# Session 14, call A, for the 4-GPU machine (nvidia-h200-x4). ~1 min.
# xla_ffi/tools/copy_probe.cu: copy-engine bandwidth per access pattern of
# the reduce-scatter's groups (pull against push, at once against one after
# the other), and the host cost of enqueueing a copy while kernels launch.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r57"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t build; nvcc -O2 -std=c++17 -o /tmp/copy_probe xla_ffi/tools/copy_probe.cu || exit 1
for mib in 1 16 64; do
  t "bw $mib"; timeout 60 /tmp/copy_probe bw $mib | tee "$R/copy_probe_bw_${mib}.md"
done
t host; timeout 120 /tmp/copy_probe host | tee "$R/copy_probe_host.md"
t end
