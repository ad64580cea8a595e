#!/usr/bin/env bash
# Session 11, call B, for the 4-GPU machine (nvidia-h200-x4). ~9 min.
# The Hopper kernel reads its piece offsets from a per-rank table compiled
# in (chunk_matmul.ByRank): one rank operand per op instead of an offsets
# array per launch (4-7 tiny XLA kernels per reduce-scatter).
#  1. the Pallas kernel tests and the ops' copy-engine tests on the GPUs;
#     stops if they fail;
#  2. host floor (512x4096x4096) of the Pallas schedules;
#  3. issue 6's ten reduce-scatter shapes, schedule=None, interleaved with
#     XLA's program (`none`), under stall_watch.py.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r50"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t pytest
timeout 150 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_pallas_chunk_matmul.py tests/test_ops.py -k "pallas or cuda or dma" \
  > "$R/pytest_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -1 "$R/pytest_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" "$R/pytest_gpu.txt" | head -30; exit 1; fi
t host_floor
timeout 80 python3 benchmarks/host_floor.py --ops=rs --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma/pallas,direct/c1/dma,direct/c1/dma/pallas/step \
  --rounds=7 --iters=50 --stats_calls=200 --out="$R/host_floor_512.json" > /tmp/host_floor.log 2>&1
echo "host_floor rc=$?"; cat "$R/host_floor_512.md"
t rs
timeout 290 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=270 --out_dir="$R" --tag=w4_ten_s11b > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s11b.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s11b.json"
ls "$R"
t end
