#!/usr/bin/env bash
# Session 6, call A on the 2-GPU machine (nvidia-h200-x2; the 4-GPU kind was
# withheld then). ~2 min:
#  1. the copy-engine tests on real GPUs: protocol (host counters with the
#     reset/read split), window transport (the CUDA watchdog rescue of a rank
#     that never arrives, now runnable on 2 GPUs), ops and gradients incl.
#     the compute_granularity="step" reduce-scatter (at P = 2 it has one peer);
#  2. timing_noise.py: one program against itself, rounds of 20 calls vs
#     rounds stretched to >= 25 ms, on a short and a longer reduce-scatter;
#  3. the host floor at P = 2, piece vs step;
#  4. rs_bench at P = 2 with the new labels (smoke of the 4-GPU script).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results29; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
python3 -c "import jax, ficco_jax; from ficco_jax._src.dma import library; print(jax.__version__, jax.devices(), library.cuda_compiled())"
t pytest
timeout 100 python3 -P -m pytest -q -p no:cacheprovider tests/test_dma_protocol.py \
  tests/test_window_transport.py -k cuda > "$R/pytest_protocol_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_protocol_gpu.txt"
timeout 120 python3 -P -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_grad.py \
  -k "dma or granular or step" > "$R/pytest_ops_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -1 "$R/pytest_ops_gpu.txt"
t noise
for m in 2048 8192; do
  timeout 100 python3 benchmarks/timing_noise.py --m=$m --k=14336 --n=4096 --axis_size=2 \
    --schedules=direct/c1/dma,direct/c2/dma/xla/step --round_settings=0,25 --passes=2 \
    --rounds=9 --iters=20 --out="$R/timing_noise_m$m.json" > "$R/timing_noise_m$m.log" 2>&1
  echo "noise m=$m rc=$?"; grep -E "^pass|worst" "$R/timing_noise_m$m.log"
done
t host_floor
timeout 60 python3 benchmarks/host_floor.py --axis_size=2 --ops=rs,ag --m=512 --k=4096 --n=4096 \
  --schedules=direct/c1/dma,direct/c1/dma/xla/step,ring/c1/dma --rounds=7 --iters=50 \
  --stats_calls=200 --out="$R/host_floor_w2.json" > "$R/host_floor.log" 2>&1
echo "host_floor rc=$?"; grep -E "^\| (rs|ag)" "$R/host_floor_w2.md"
t rs
timeout 100 python3 benchmarks/rs_bench.py --axis_sizes=2 --models=llama3-8b,llama3-70b \
  --tokens=4096 --square=false \
  --schedules=default,none,direct/c1/dma,direct/c2/dma/xla/step,ring/c1/dma \
  --interleave --rounds=7 --iters=20 --time_budget_s=85 --out_dir="$R" --tag=w2_smoke \
  > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w2_smoke.md" | cut -c1-250
t end
tar -czf "$OUT/results29.tar.gz" -C "$R" .
