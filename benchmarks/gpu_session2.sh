#!/usr/bin/env bash
# The test suite on the GPUs, then the full benchmark (run_gpu.sh), in one
# command that fits the device tool's 10 minutes. $OUT gets pytest_gpu.txt
# plus run_gpu.sh's seven files.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps . > /dev/null 2>&1 || echo "install FAILED"
# -P: no repository root on sys.path, so the installed package (with its
# compiled library) is tested, as with the README's .venv/bin/pytest.
timeout ${PYTEST_S:-150} python3 -P -m pytest -q -p no:cacheprovider -rs tests \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -15 "$OUT/pytest_gpu.txt"
bash benchmarks/run_gpu.sh
