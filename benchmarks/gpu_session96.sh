#!/usr/bin/env bash
# Session 21, for the 2-GPU machine (nvidia-h200-x2). ~5 min.
# The flagged reduce-scatter across processes (a job of several processes
# pushes: xla_ffi/WINDOWS.md, "Push"): mp_worker's push mode on one GPU per
# process, then matmul_reduce_scatter timed against XLA's dot +
# psum_scatter with 2 processes x 1 GPU (flagged over push, and "piece" over
# the window transport) and, for comparison, in one process driving both
# GPUs (flagged over the rendezvous transport and over push).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r96; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t "mp worker push"
timeout 180 python3 -m ficco_jax.launch -n 2 --timeout_s=170 tests/mp_worker.py push > "$R/mp_worker_push.log" 2>&1
echo "mp worker push rc=$?"; tail -3 "$R/mp_worker_push.log"
CASES=4096x14336x4096,4096x8192x8192,4096x28672x8192
t "2 processes x 1 GPU"
timeout 200 python3 -m ficco_jax.launch -n 2 --timeout_s=190 benchmarks/mp_ag_bench.py --op=rs \
  --cases=$CASES --schedules=direct:1:dma:pallas:flagged,direct:1:dma:pallas:piece \
  --rounds=7 --iters=20 --out_dir="$R" --tag=mp2x1 > "$R/mp2x1.log" 2>&1
echo "rc=$?"; grep -E "^\|" "$R/mp_rs_mp2x1.md" || tail -5 "$R/mp2x1.log"
t "1 process x 2 GPUs"
timeout 150 python3 benchmarks/mp_ag_bench.py --op=rs \
  --cases=$CASES --schedules=direct:1:dma:pallas:flagged \
  --rounds=7 --iters=20 --out_dir="$R" --tag=sp_rendezvous > "$R/sp_rendezvous.log" 2>&1
echo "rc=$?"; grep -E "^\|" "$R/mp_rs_sp_rendezvous.md" || tail -5 "$R/sp_rendezvous.log"
FICCO_FLAGGED_TRANSPORT=push timeout 150 python3 benchmarks/mp_ag_bench.py --op=rs \
  --cases=$CASES --schedules=direct:1:dma:pallas:flagged \
  --rounds=7 --iters=20 --out_dir="$R" --tag=sp_push > "$R/sp_push.log" 2>&1
echo "rc=$?"; grep -E "^\|" "$R/mp_rs_sp_push.md" || tail -5 "$R/sp_push.log"
tar czf "$OUT/r96.tgz" -C /tmp r96; ls -la "$OUT"
t end
