#!/usr/bin/env bash
# Session 3, call G on the 4-GPU machine (~1.5 min): schedule=None on the
# short ops after the cache kept overlap only where it wins in both the
# median and the fastest round (the two shapes call F found slower than XLA).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results17; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t rs; timeout 45 python3 benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-8b --tokens=4096,8192 \
  --square=false --cases=4096x8192x8192 --schedules=default --interleave --rounds=9 --iters=20 \
  --out_dir="$R" --tag=w4_short > "$R/rs.log" 2>&1; echo "rc=$?"
t ag; timeout 45 python3 benchmarks/ag_bench.py --axis_sizes=4 --models=llama3-8b --tokens=4096,8192 \
  --square=false --cases=4096x8192x8192,2048x8192x8192 --schedules=default --peers= --interleave \
  --rounds=9 --iters=20 --out_dir="$R" --tag=w4_short > "$R/ag.log" 2>&1; echo "rc=$?"
t end
tar -czf "$OUT/results17.tar.gz" -C "$R" .
for f in "$R"/*.md; do grep -E "^\| [a-z]" "$f" | cut -d"|" -f2,4,7,9; done
