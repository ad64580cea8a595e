#!/usr/bin/env bash
# Session 12, call A, for the 4-GPU machine (nvidia-h200-x4). ~9 min.
# The reduce-scatter's own rows can add the pulled partials in the Pallas
# kernel's epilogue (Schedule.reduce_in_epilogue) instead of a separate pass.
#  1. the Pallas kernel tests and the ops' copy-engine tests on the GPUs
#     (the epilogue schedules among them; also the first GPU run of a9df22c's
#     kernel signature); stops if they fail;
#  2. compiled HLO of direct/c1/dma/pallas at llama3-8b M4096 (the shared
#     rank operand, command buffers);
#  3. the own rows on one GPU: kernel, kernel + XLA's sum, epilogue (c1, c2);
#  4. five reduce-scatter shapes: schedule=None against the epilogue
#     schedules, interleaved, under stall_watch.py.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r51"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t pytest
timeout 170 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_pallas_chunk_matmul.py tests/test_ops.py -k "pallas or cuda or dma" \
  > "$R/pytest_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -1 "$R/pytest_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" "$R/pytest_gpu.txt" | head -30; exit 1; fi
t hlo
timeout 60 python3 benchmarks/hlo_dump.py --m=4096 --k=14336 --n=4096 \
  --schedule=direct/c1/dma/pallas --out=/tmp/rs_llama8b_m4096.hlo.txt > "$R/hlo_counts.txt" 2>/tmp/hlo.log
echo "hlo rc=$?"; cat "$R/hlo_counts.txt"
grep -n "partition-id\|mosaic" /tmp/rs_llama8b_m4096.hlo.txt | cut -c1-200 | head -12
t epilogue
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/epilogue_bench.py --out="$R/epilogue_h200.json" > /tmp/epi.log 2>&1
echo "epilogue rc=$?"; cat "$R/epilogue_h200.md" 2>/dev/null || tail -20 /tmp/epi.log
t rs
timeout 300 python3 benchmarks/stall_watch.py --out=/tmp/stall.txt --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-70b,qwen2-72b --tokens=4096 --square=true --cases=8192x14336x4096 \
  --schedules=default,direct/c2/dma/pallas/epi,direct/c4/dma/pallas/epi,direct/c2/dma/pallas/step/epi \
  --interleave --rounds=5 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=270 --out_dir="$R" --tag=w4_epi_s12a > /tmp/rs.log 2>&1
echo "rs rc=$?"; head -20 /tmp/stall.txt; tail -3 /tmp/rs.log
grep -E "^\|" "$R/rs_w4_epi_s12a.md" | cut -c1-250
python3 benchmarks/rs_summary.py "$R/rs_w4_epi_s12a.json"
ls "$R"
t end
