#!/usr/bin/env bash
# Session 14, call C, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# The protocol's host waits no longer take the invocation's mutex while they
# spin (they poll atomics), and the registry's and event pools' short
# sections take a spin mutex instead of a futex-backed one.
#  1. install this tree, and the previous commit's package (_ab_old/, made
#     before the call by: mkdir _ab_old && git archive 40e2a5c pyproject.toml
#     CMakeLists.txt ficco_jax xla_ffi README.md | tar -x -C _ab_old; not
#     committed) into /tmp/old, in parallel;
#  2. the protocol's and the ops' CUDA tests on this tree; stops on failure;
#  3. host floor at 512x4096x4096 (piece, halving, step): old, new, old,
#     new, one process each (the change is compiled in).
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r58"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
t install
python3 -m pip install --no-build-isolation --no-deps . > /tmp/install.log 2>&1 &
p1=$!
if [ -d _ab_old ]; then
  python3 -m pip install --no-build-isolation --no-deps --target /tmp/old ./_ab_old > /tmp/install_old.log 2>&1 &
  p2=$!
fi
wait $p1 || { echo "install FAILED"; grep -E "error" /tmp/install.log | head -20; exit 1; }
[ -d _ab_old ] && { wait $p2 || { echo "old install FAILED"; grep -E "error" /tmp/install_old.log | head; }; }
t pytest
timeout 260 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_dma_protocol.py tests/test_ops.py -k "cuda or dma" \
  > "$R/pytest_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -1 "$R/pytest_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error|FAILED" "$R/pytest_gpu.txt" | head -30; exit 1; fi
floor() {  # $1 tag, then env for python
  local tag=$1; shift
  t "floor $tag"
  env "$@" timeout 150 python3 benchmarks/host_floor.py --ops=rs --m=512 --k=4096 --n=4096 \
    --schedules=direct/c1/dma/pallas,direct/c1/dma/pallas/halving,direct/c1/dma/pallas/step \
    --rounds=7 --iters=50 --out="$R/host_floor_512_$tag.json" > /tmp/floor_$tag.log 2>&1
  echo "floor $tag rc=$?"; cat "$R/host_floor_512_$tag.md" 2>/dev/null || tail -20 /tmp/floor_$tag.log
}
[ -d /tmp/old/ficco_jax ] && floor old1 PYTHONPATH=/tmp/old
floor new FICCO_AB=new
[ -d /tmp/old/ficco_jax ] && floor old2 PYTHONPATH=/tmp/old
floor new2 FICCO_AB=new
ls "$R"
t end
