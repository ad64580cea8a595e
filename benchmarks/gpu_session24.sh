#!/usr/bin/env bash
# Session 5, call A on the 4-GPU machine (~5 min): the protocol's sync now
# waits only for the copies that read this rank's buffers and, per copy
# queue, only for the newest of them (direct reduce-scatter: 15 stream waits
# per sync -> 4); start records no separate per-queue "final" events; the
# handlers count their own host time (library.host_stats).
#  1. the copy-engine tests on the GPUs (protocol incl. the stream-wait
#     counts, HLO, both ops, gradients);
#  2. the host floor (512x4096x4096, both ops) with the handlers' counters;
#  3. the short reduce-scatter shapes, where the host cost shows.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results24; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_dma_protocol.py -k cuda \
  > "$R/pytest_protocol_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_protocol_gpu.txt"
timeout 110 python3 -P -m pytest -q -p no:cacheprovider tests/test_hlo.py tests/test_ops.py \
  tests/test_grad.py -k "hlo or reduce_scatter or rs or grad or dma" > "$R/pytest_ops_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -3 "$R/pytest_ops_gpu.txt"
t host_floor
timeout 120 python3 benchmarks/host_floor.py --ops=rs,ag --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma,ring/c1/dma,bidirectional/c1/dma --rounds=7 --iters=50 \
  --stats_calls=200 --out="$R/host_floor_512.json" > "$R/host_floor.log" 2>&1
echo "host_floor rc=$?"
t rs
timeout 150 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b --tokens=4096,8192 --square=false --cases=4096x8192x8192 \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,ring/c1/dma,ring/c1/dma/pallas \
  --interleave --rounds=7 --iters=20 --time_budget_s=130 --out_dir="$R" --tag=w4_short \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"
t end
tar -czf "$OUT/results24.tar.gz" -C "$R" .
cat "$R"/host_floor_512.md
cat "$R"/*short*.md | grep -E "^\|" | cut -c1-250 | head -40
