#!/usr/bin/env bash
# Session 17, call E, for the 4-GPU machine (nvidia-h200-x4). ~3 min.
# Call D rejected the hardware-queue hypothesis (more connections or one
# flag stream per piece change nothing). Profiles (JAX profiler, 10 calls)
# of flagged c1 and piece c1 at square 16384 and llama3-8b M8192, so the
# timeline says whether flagged's copies start late (flags), run slow
# (contention) or its kernel runs long beside them.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r74; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
t profile
SQ=rs:16384x8192x8192; L8=rs:8192x14336x4096
timeout 200 python3 benchmarks/profile_ops.py --out_dir=/tmp/prof_e \
  --specs=$SQ:direct/c1/dma/pallas/flagged,$SQ:direct/c1/dma/pallas,$L8:direct/c1/dma/pallas/flagged,$L8:direct/c1/dma/pallas \
  > "$R/profile.txt" 2>&1
echo "profile rc=$?"
grep -E "^# |window|MemcpyP2P\)|copies off|mosaic_gpu_kernel|idle" "$R/profile.txt" | grep -v "^\s*-\?[0-9.]* .*loop_" | head -60
tar czf "$OUT/r74.tgz" -C /tmp r74; ls -la "$OUT"
t end
