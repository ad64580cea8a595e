#!/usr/bin/env bash
# Final measurement call on the 4-GPU machine (about 9 minutes): the test
# suite on the GPUs, a fresh copy-engine characterisation, the AG/RS
# benchmark with the peers (run_gpu.sh), and the tensor-parallel block's
# training step with and without ficco ops. At most 8 files land in $OUT.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps . > /dev/null 2>&1 || echo "install FAILED"
timeout ${PYTEST_S:-70} python3 -P -m pytest -q -p no:cacheprovider -rs tests \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -4 "$OUT/pytest_gpu.txt"
RES=/tmp/ficco_results; rm -rf "$RES"; mkdir -p "$RES"
timeout ${CHAR_S:-50} python3 benchmarks/characterize.py --out_dir="$RES" \
  --sections=copy,contention --time_budget_s=$(( ${CHAR_S:-50} - 8 )) > "$RES/characterize.log" 2>&1
echo "characterize rc=$?"
timeout ${TP_S:-125} python3 benchmarks/tp_block_bench.py --out_dir="$RES" \
  --d_model=${TP_D:-4096} --heads=32 --d_ff=${TP_F:-14336} --seq=${TP_SEQ:-8192} \
  --variant_timeout_s=$(( ${TP_S:-125} / 2 - 3 )) --rounds=3 --iters=5 > "$RES/tp_block.log" 2>&1
echo "tp_block rc=$?"; tail -5 "$RES/tp_block.log"
# run_gpu.sh writes its 7 files into $OUT (results.tar.gz holds every JSON
# in $RES, the characterisation and the block benchmark included).
RES=$RES KEEP_RES=1 INSTALL=skip bash benchmarks/run_gpu.sh
