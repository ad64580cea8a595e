#!/usr/bin/env bash
# Session 3, call C on the 4-GPU machine (~2 min): host self time per event
# (profile_summary.py) of short copy-engine ops against XLA's program.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results13; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t profile_ops
timeout 150 python3 benchmarks/profile_ops.py --calls=10 --out_dir="$R" --specs=\
rs:512x4096x4096:xla,rs:512x4096x4096:direct/c1/dma,rs:4096x8192x8192:direct/c1/dma,\
ag:4096x8192x8192:ring/c1/dma > "$R/profile_ops.log" 2>&1
echo "profile_ops rc=$?"
t end
tar -czf "$OUT/results13.tar.gz" -C "$R" .
