#!/usr/bin/env bash
# Session 13, call B, for the 4-GPU machine (nvidia-h200-x4). ~9 min.
# The reduce-scatter's halving granularity (Schedule compute_granularity=
# "halving": on 4 devices one dot and one start for 2 peers, then one for
# the last, instead of one per peer), aimed at the host-bound shapes.
#  1. the Pallas kernel tests and the ops' copy-engine tests on the GPUs
#     (halving among them; also the first GPU run of 06a3c33's mend);
#     stops if they fail;
#  2. host floor at 512x4096x4096: piece, halving and step at c1;
#  3. issue 6's ten shapes: schedule=None, none, piece c1, halving c1/c2,
#     interleaved, under stall_watch.py.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r54"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t pytest
timeout 200 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_pallas_chunk_matmul.py tests/test_ops.py -k "pallas or cuda or dma or halving" \
  > "$R/pytest_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -1 "$R/pytest_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" "$R/pytest_gpu.txt" | head -30; exit 1; fi
t floor
timeout 120 python3 benchmarks/host_floor.py --ops=rs --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma/pallas,direct/c1/dma/pallas/halving,direct/c1/dma/pallas/step \
  --rounds=7 --iters=50 --out="$R/host_floor_512.json" > /tmp/floor.log 2>&1
echo "floor rc=$?"; cat "$R/host_floor_512.md" 2>/dev/null || tail -20 /tmp/floor.log
t rs
timeout 330 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma/pallas,direct/c1/dma/pallas/halving,direct/c2/dma/pallas/halving \
  --interleave --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=290 --out_dir="$R" --tag=w4_ten_s13b > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt 2>/dev/null; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_ten_s13b.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s13b.json"
ls "$R"
t end
