#!/usr/bin/env bash
# Session 22, call E, the 4-GPU machine (nvidia-h200-x4), one lease. ~7 min.
# After push became the flagged reduce-scatter's default: the push, flagged
# and arm tests on the GPUs; the host-bound pair as shipped against the
# rendezvous transport (#rendezvous) in PAIRS processes, one after another,
# each interleaved with XLA's program; then issue 6's ten shapes as shipped
# (ten_shapes.sh). Writes $OUT/r102.tgz and $OUT/r102t.tgz.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r102; rm -rf "$R"; mkdir -p "$R"
PAIRS=${PAIRS:-4}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
flagged_gpu_tests "$R"
for n in $(seq 1 "$PAIRS"); do
  t "pair $n"
  timeout 60 python3 benchmarks/host_bound_probe.py \
    --cases=llama3-8b/M4096:4096x14336x4096,square/4096:4096x8192x8192 \
    --schedules=default,default#rendezvous --axis_sizes=4 --chain=0 --rounds=7 --iters=20 \
    --out_dir="$R" --tag=s22e_$n > "$R/probe_$n.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|trivial|default)" "$R/host_bound_s22e_$n.md" | cut -d'|' -f2-5 | tr '\n' ' '; echo
done
tar czf "$OUT/r102.tgz" -C /tmp r102; ls -la "$OUT"
bash "$(dirname "$0")/ten_shapes.sh" r102t s22_shipped
