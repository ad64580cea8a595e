#!/usr/bin/env bash
# Session 2, call E on the 4-GPU machine (~3 min): the window transport with
# piecewise staging, one process (against the rendezvous transport) and four.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results9; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > /dev/null 2>&1 || echo "install FAILED"
t tests
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_window_transport.py > "$R/pytest_window.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_window.txt"
timeout 60 python3 -m ficco_jax.launch -n 4 --timeout_s=55 tests/mp_worker.py dma > "$R/mp4x1_dma.log" 2>&1
echo "mp4x1 dma rc=$?"
t sp
timeout 100 python3 benchmarks/mp_ag_bench.py --out_dir="$R" --tag=sp_1x4_pieces \
  --transports=rendezvous,window --schedules=ring:1:dma,ring:2:dma > "$R/sp.log" 2>&1
echo "sp rc=$?"
t mp4x1
timeout 80 python3 -m ficco_jax.launch -n 4 --timeout_s=75 benchmarks/mp_ag_bench.py \
  --out_dir="$R" --tag=mp_4x1_pieces --schedules=ring:1:dma,ring:2:dma,bidirectional:1:dma \
  > "$R/mp4x1.log" 2>&1
echo "mp rc=$?"
t end
tar -czf "$OUT/results9.tar.gz" -C "$R" .
cat "$R"/*.md | grep -E "^\|" | head -40
