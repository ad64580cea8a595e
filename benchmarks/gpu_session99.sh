#!/usr/bin/env bash
# Session 21, for the 2-GPU machine (nvidia-h200-x2). ~3 min.
# Where push's GPU time goes at W=2 (call D: push 1-4% slower than the
# rendezvous path, interleaved): jax's profiler (host_profile.py, CUPTI) on
# the flagged c1 op at llama3-70b M4096 and llama3-8b M4096, once per
# transport, for each stream's kernels and copies per call.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r99; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
profile_transports "$R" s21e 2 \
  llama3-70b/M4096:4096x28672x8192,llama3-8b/M4096:4096x14336x4096 \
  direct/c1/dma/pallas/flagged
tar czf "$OUT/r99.tgz" -C /tmp r99; ls -la "$OUT"
t end
