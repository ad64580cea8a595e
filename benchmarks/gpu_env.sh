# Sourced by the gpu_session*.sh scripts: the repo root, $OUT, the
# environment every child inherits, a timestamped log helper `t`,
# `install_ficco`, `flagged_gpu_tests` and `profile_transports`.
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
# The flagged reduce-scatter's tests on the GPUs (push protocol, flagged op
# cases, the protocol's flagged and arm tests), run from /tmp against the
# installed package; logs in $1/tests.log and $1/tests_protocol.log.
flagged_gpu_tests() {
  t tests
  (cd /tmp && timeout 240 python3 -m pytest -q -x "$OLDPWD/tests/test_push_transport.py" \
    "$OLDPWD/tests/test_ops.py" -k "push or flagged or pads_k" ) > "$1/tests.log" 2>&1
  echo "tests rc=$?"; tail -1 "$1/tests.log"
  (cd /tmp && timeout 120 python3 -m pytest -q "$OLDPWD/tests/test_dma_protocol.py" \
    -k "flagged or arm" ) > "$1/tests_protocol.log" 2>&1
  echo "protocol tests rc=$?"; tail -1 "$1/tests_protocol.log"
}
# jax's profiler (host_profile.py) on one op, once per flagged transport,
# each in its own process: profile_transports R TAG W CASES SCHEDULE writes
# $R/host_profile_TAG_<transport>.{json,md} and $R/profile_<transport>.log.
profile_transports() {
  local T
  for T in rendezvous push; do
    t "profile $T"
    FICCO_FLAGGED_TRANSPORT=$T timeout 150 python3 benchmarks/host_profile.py \
      --cases="$4" --schedules="$5" --axis_sizes="$3" --calls=50 \
      --out_dir="$1" --tag="$2_$T" > "$1/profile_$T.log" 2>&1
    echo "rc=$?"; ls "$1" | grep "$2_$T" | head -3
  done
}
