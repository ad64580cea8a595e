#!/usr/bin/env bash
# Session 21, for the 2-GPU machine (nvidia-h200-x2). ~6 min.
# After the review mends of the pooled push windows (halves at the slot's
# midpoint, a failed pool replaced whole, an unfinished start refused): the
# push tests and the cross-process worker on GPUs, then the flagged
# reduce-scatter at issue 6's ten shapes at W=2 in one process, over the
# rendezvous transport and over push, each against XLA in the same run.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r97; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t tests
(cd /tmp && timeout 240 python3 -m pytest -q "$OLDPWD/tests/test_push_transport.py" "$OLDPWD/tests/test_window_transport.py") > "$R/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$R/tests.log"
t "mp worker push"
timeout 180 python3 -m ficco_jax.launch -n 2 --timeout_s=170 tests/mp_worker.py push > "$R/mp_worker_push.log" 2>&1
echo "mp worker push rc=$?"
CASES=4096x14336x4096,8192x14336x4096,4096x28672x8192,8192x28672x8192,4096x29568x8192,8192x29568x8192,4096x49152x12288,8192x49152x12288,4096x8192x8192,16384x8192x8192
for T in rendezvous push; do
  t "ten shapes, W=2, one process, $T"
  FICCO_FLAGGED_TRANSPORT=$T timeout 150 python3 benchmarks/mp_ag_bench.py --op=rs \
    --cases=$CASES --schedules=direct:1:dma:pallas:flagged \
    --rounds=5 --iters=10 --out_dir="$R" --tag=ten_w2_$T > "$R/ten_$T.log" 2>&1
  echo "rc=$?"; grep -E "^\|" "$R/mp_rs_ten_w2_$T.md" || tail -5 "$R/ten_$T.log"
done
tar czf "$OUT/r97.tgz" -C /tmp r97; ls -la "$OUT"
t end
