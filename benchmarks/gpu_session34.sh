#!/usr/bin/env bash
# Session 7, call A, for the 4-GPU machine (nvidia-h200-x4). ~8 min:
#  1. the Pallas tests on the Hopper kernel, including compute_granularity=
#     "step" with compute="pallas" (one launch reads 3 peers' wrapped rows in
#     place for the reduce-scatter, writes 3 owners' rows for the
#     all-gather), and the step gradients;
#  2. timing_noise.py on a long shape (gpt3-175b M4096, where session 6 read
#     ficco's `none` at 0.91x of the same executable) and the shortest
#     (llama3-8b M4096): session 6's harness (rotate) against the new one
#     (shuffle + 10 ms settle), >= 25 ms rounds;
#  3. issue 6's ten reduce-scatter shapes under the new harness, with the
#     step + pallas candidates.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r34"; rm -rf "$R"; mkdir -p "$R"  # straight into $OUT: a cut call still returns its files
nvidia-smi --query-gpu=name --format=csv,noheader
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 150 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_ops.py tests/test_grad.py \
  tests/test_pallas_chunk_matmul.py -k "pallas or step or pieces" > "$R/pytest_pallas_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_pallas_gpu.txt"
for shape in "4096 49152 12288 gpt3_m4096" "4096 14336 4096 llama8b_m4096"; do
  set -- $shape
  t "noise $4"
  timeout 80 python3 benchmarks/timing_noise.py --m=$1 --k=$2 --n=$3 --axis_size=4 \
    --schedules=direct/c1/dma --round_settings=25 --harnesses=rotate,shuffle --passes=2 \
    --rounds=9 --iters=20 --out="$R/timing_noise_$4.json" > "$R/timing_noise_$4.log" 2>&1
  echo "noise rc=$?"; grep -E "^pass|worst" "$R/timing_noise_$4.log" | cut -c1-300
done
t rs
timeout 300 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,direct/c2/dma/pallas,direct/c1/dma/pallas/step,direct/c2/dma/pallas/step,ring/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=280 --out_dir="$R" --tag=w4_issue6 > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_issue6.md" | cut -c1-250
t end
