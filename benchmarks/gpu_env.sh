# Sourced by the gpu_session*.sh scripts: the repo root, $OUT, the
# environment every child inherits, and a timestamped log helper `t`.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
# NVLink multicast must stay off on these machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] $*"; }
