#!/usr/bin/env bash
# For the 4-GPU machine (nvidia-h200-x4), written in session 6 when that kind
# was withheld; it ran as session 6 call B when the kind was lent late. ~4 min:
#  1. the copy-engine tests on 4 GPUs (-rs lists what skipped and why),
#     including compute_granularity="step" at P = 4 (three peers per start);
#  2. timing_noise.py on issue 6's shortest shape (llama3-8b M4096): one
#     program against itself with 20-call rounds and with >= 25 ms rounds
#     (the session-5 "none slower than XLA" reading);
#  3. issue 6's ten reduce-scatter shapes: schedule=None and the candidates,
#     the step granularity among them, rounds stretched to >= 25 ms.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r30"; rm -rf "$R"; mkdir -p "$R"  # straight into $OUT: a cut call still returns its files
nvidia-smi --query-gpu=name --format=csv,noheader
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 120 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_dma_protocol.py \
  tests/test_window_transport.py -k cuda > "$R/pytest_protocol_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_protocol_gpu.txt"
timeout 110 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_ops.py tests/test_grad.py \
  -k "dma or granular or step" > "$R/pytest_ops_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_ops_gpu.txt"
t noise
timeout 90 python3 benchmarks/timing_noise.py --m=4096 --k=14336 --n=4096 --axis_size=4 \
  --schedules=ring/c1/dma,direct/c1/dma/xla/step --round_settings=0,25 --passes=2 \
  --rounds=9 --iters=20 --out="$R/timing_noise_m4096.json" > "$R/timing_noise.log" 2>&1
echo "noise rc=$?"; grep -E "^pass|worst" "$R/timing_noise.log"
t rs
timeout 250 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,direct/c1/dma/xla/step,direct/c2/dma/xla/step,ring/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --time_budget_s=230 --out_dir="$R" \
  --tag=w4_issue6 > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_issue6.md" | cut -c1-250
t end
