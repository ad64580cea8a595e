#!/usr/bin/env bash
# Session 22, call I, the 4-GPU machine (nvidia-h200-x4). ~3 min.
# Where push loses 2-4% at the GPU-bound square 4096 (calls E and G): jax's
# profiler (host_profile.py, CUPTI) on the op as shipped, once per flagged
# transport, for each stream's kernels and copies per call at W=4.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r103p; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
profile_transports "$R" s22i 4 square/4096:4096x8192x8192 default
tar czf "$OUT/r103p.tgz" -C /tmp r103p; ls -la "$OUT"
t end
