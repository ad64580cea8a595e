#!/usr/bin/env bash
# Session 15, call B, for the 4-GPU machine (nvidia-h200-x4). ~4 min.
# Call A's host timeline showed the slow rounds of llama3-8b M4096 spending
# longer in XLA's own execute path, with no CPU contention: a host throttled
# by a full launch queue (the GPU slow) or a slower host. GPU stamps
# (host_timeline.py --gpu_stamps) tell them apart: how far the GPU runs
# behind the host, and where its time goes. Runs:
#  1. llama3-8b M4096 with GPU stamps, 30 rounds of 80 calls;
#  2. the same without stamps (their cost);
#  3. llama3-8b M4096 with stamps, 12 rounds of 400 calls;
#  4. square 4096 with stamps, 24 rounds of 80 calls.
# Everything lands in one archive, $OUT/r63.tgz (the tool returns 8 files).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r63; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
L8="--m=4096 --k=14336 --n=4096"
run_tl() {  # name, then flags
  local name=$1; shift
  t "timeline $name"
  timeout 150 python3 benchmarks/host_timeline.py --schedules=default --warmup=3 \
    --variant="$name" --out="$R/tl_$name.json" "$@" > "$R/tl_$name.log" 2>&1
  echo "rc=$?"; grep -E "^median|^ficco rounds|^XLA rounds|Error" "$R/tl_$name.log" | head -5
  grep -E "gpu lag|gpu: |gpu copy|period us|sync_enter->sync_issued|sync_exit->start_enter0|py_xla_execute: run" "$R/tl_$name.md"
}
run_tl l8_gpu $L8 --rounds=30 --iters=80 --gpu_stamps
run_tl l8_host $L8 --rounds=24 --iters=80
run_tl l8_gpu_long $L8 --rounds=12 --iters=400 --gpu_stamps
run_tl sq4096_gpu --m=4096 --k=8192 --n=8192 --rounds=24 --iters=80 --gpu_stamps
tar czf "$OUT/r63.tgz" -C /tmp r63; ls -la "$OUT"
t end
