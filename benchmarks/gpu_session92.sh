#!/usr/bin/env bash
# Session 20, for the 4-GPU machine (nvidia-h200-x4; W=2 on nvidia-h200-x2,
# where the pair runs the flagged schedule by name). ~5 min.
# The push protocol of the flagged reduce-scatter (FICCO_FLAGGED_TRANSPORT=
# push, xla_ffi/WINDOWS.md "Push"): its tests on the GPUs (and the flagged
# tests of the rendezvous path, unvalidated since session 19's mends), then
# its host floor and the host-bound pair against the rendezvous path, in
# four processes, interleaved with XLA's program.
# Since e0ab802 (session 22) push is the flagged default: the labels are
# "X#rendezvous" and "X" where they were "X" and "X#push" when the session
# 20-22 results were taken (the same two programs).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r92; rm -rf "$R"; mkdir -p "$R"
W=${W:-4}; PAIRS=${PAIRS:-4}
if [ "$W" = 4 ]; then L=default; else L=direct/c1/dma/pallas/flagged; fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
flagged_gpu_tests "$R"
t floor
timeout 60 python3 benchmarks/host_bound_probe.py --cases=512x4096x4096 \
  --schedules=direct/c1/dma/pallas/flagged#rendezvous,direct/c1/dma/pallas/flagged \
  --axis_sizes=$W --chain=0 --rounds=9 --iters=50 --out_dir="$R" --tag=s20a_floor > "$R/floor.log" 2>&1
echo "rc=$?"; grep -E "^\| (xla|trivial|direct)" "$R/host_bound_s20a_floor.md" | cut -d'|' -f2-5
for n in $(seq 1 "$PAIRS"); do
  t "pair $n"
  timeout 60 python3 benchmarks/host_bound_probe.py \
    --cases=llama3-8b/M4096:4096x14336x4096,square/4096:4096x8192x8192 \
    --schedules=$L#rendezvous,$L --axis_sizes=$W --chain=0 --rounds=7 --iters=20 \
    --out_dir="$R" --tag=s20a_$n > "$R/probe_$n.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|trivial|default|direct)" "$R/host_bound_s20a_$n.md" | cut -d'|' -f2-5 | tr '\n' ' '; echo
done
tar czf "$OUT/r92.tgz" -C /tmp r92; ls -la "$OUT"
t end
