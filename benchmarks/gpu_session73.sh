#!/usr/bin/env bash
# Session 17, call D, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# Why flagged c1 loses to piece c1 end to end on the comm-heavy shapes
# (call C: square 16384 1.32x against 1.53x) while its kernel alone is
# within 1-3% of piece c1's launches (call B). Hypothesis: the flag
# stream's blocking cuStreamWaitValue32 shares a hardware queue with a copy
# stream, so a pull that is ready queues behind a wait for a later piece.
# Three processes, same four comm-heavy shapes, flagged c1 and piece c1
# interleaved in each: as is; CUDA_DEVICE_MAX_CONNECTIONS=32 (more
# hardware queues); FICCO_FLAG_STREAMS=piece (one flag stream per piece).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r73; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
run() {  # tag, then env assignments
  local tag=$1; shift
  t "$tag"
  env "$@" timeout 150 python3 benchmarks/stall_watch.py --out="$R/stall_$tag.txt" --stall_s=40 -- \
    benchmarks/rs_bench.py --axis_sizes=4 --models=llama3-8b --tokens=4096,8192 --square=true \
    --schedules=direct/c1/dma/pallas/flagged,direct/c1/dma/pallas \
    --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
    --time_budget_s=120 --out_dir="$R" --tag="$tag" > "$R/rs_$tag.log" 2>&1
  echo "$tag rc=$?"; python3 benchmarks/rs_summary.py "$R/rs_$tag.json"
}
run s17d_asis FICCO_NOP=1
run s17d_conn32 CUDA_DEVICE_MAX_CONNECTIONS=32
run s17d_flagpiece FICCO_FLAG_STREAMS=piece
tar czf "$OUT/r73.tgz" -C /tmp r73; ls -la "$OUT"
t end
