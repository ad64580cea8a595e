#!/usr/bin/env bash
# Session 10, call A, for the 4-GPU machine (nvidia-h200-x4). ~8 min. Async
# issue now never enqueues a stream wait before the copy it waits for: sync
# waits, bounded, for the issue (the device flags are gone), and each
# issuer thread is bound to its device once.
#  1. the peer-copy protocol and the ops' copy-engine tests on the GPUs,
#     under both CUDA issue modes; stops here if they fail;
#  2. the host floor (512x4096x4096) of three reduce-scatter schedules
#     under each issue mode;
#  3. the four short reduce-scatter shapes (llama3-8b, the squares), the
#     main schedules under async, ring/c1/dma (the one that stalled in
#     session 9 call C) included, watched by stall_watch.py.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r46"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || { echo "install FAILED"; grep -E "error" "$R/install.log" | head -20; exit 1; }
t pytest
timeout 170 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_dma_protocol.py tests/test_ops.py -k "cuda or dma or async" \
  > "$R/pytest_dma_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -2 "$R/pytest_dma_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" "$R/pytest_dma_gpu.txt" | head -30; exit 1; fi
t host_floor
timeout 110 python3 benchmarks/host_floor.py --ops=rs --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma@parallel,direct/c1/dma@async,direct/c1/dma/pallas/step@parallel,direct/c1/dma/pallas/step@async,ring/c1/dma@parallel,ring/c1/dma@async \
  --rounds=7 --iters=50 --stats_calls=200 --out="$R/host_floor_512.json" > "$R/host_floor.log" 2>&1
echo "host_floor rc=$?"; cat "$R/host_floor_512.md"
t rs
timeout 230 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b --tokens=4096,8192 --square=true \
  --schedules=default@parallel,default@async,none,direct/c1/dma@parallel,direct/c1/dma@async,direct/c1/dma/pallas@async,direct/c1/dma/pallas/step@async,ring/c1/dma@async \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=210 --out_dir="$R" --tag=w4_short_s10a > "$R/rs.log" 2>&1
echo "rs rc=$?"; [ -f "$R/stall.txt" ] && head -40 "$R/stall.txt"
grep -E "^\|" "$R/rs_w4_short_s10a.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_short_s10a.json"
ls "$R"
t end
