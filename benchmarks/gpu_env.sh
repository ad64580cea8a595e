# Sourced by the gpu_session*.sh scripts: the repo root, $OUT, the
# environment every child inherits, a timestamped log helper `t` and
# `install_ficco`.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
# NVLink multicast must stay off on these machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] $*"; }
# Installs this tree (the GPU image has no package index: build deps come
# from the image); on failure prints the build's errors and ends the script.
install_ficco() {
  t install
  python3 -m pip install --no-build-isolation --no-deps . > /tmp/install.log 2>&1 \
    || { echo "install FAILED"; grep -E "error" /tmp/install.log | head -20; exit 1; }
}
