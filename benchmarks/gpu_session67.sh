#!/usr/bin/env bash
# Session 15, call F, for the 4-GPU machine (nvidia-h200-x4). ~3 min.
# After the review mends of the host timeline (per-trace buffers, the
# issuer's last event before "issued", env.h): the peer-copy protocol's GPU
# tests, including the trace and GPU-stamp tests, on 4 GPUs; one archive.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r67; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
install_ficco
t tests
(cd /tmp && timeout 300 python3 -P -m pytest -q "$OLDPWD/tests/test_dma_protocol.py" -k "cuda" \
  > "$R/pytest_gpu.txt" 2>&1); echo "pytest rc=$?"; tail -3 "$R/pytest_gpu.txt"
tar czf "$OUT/r67.tgz" -C /tmp r67
t end
