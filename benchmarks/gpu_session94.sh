#!/usr/bin/env bash
# Session 20, the host floor of the flagged reduce-scatter over the
# rendezvous path and the push protocol, in several processes (W devices,
# default 2 for nvidia-h200-x2; 4 on nvidia-h200-x4). ~2 min.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r94; rm -rf "$R"; mkdir -p "$R"
W=${W:-2}; N=${N:-5}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
for n in $(seq 1 "$N"); do
  t "floor $n"
  timeout 60 python3 benchmarks/host_bound_probe.py --cases=512x4096x4096 \
    --schedules=direct/c1/dma/pallas/flagged,direct/c1/dma/pallas/flagged#push \
    --axis_sizes=$W --chain=0 --rounds=9 --iters=50 --out_dir="$R" --tag=s20_floor_w${W}_$n > "$R/floor_$n.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|trivial|direct)" "$R/host_bound_s20_floor_w${W}_$n.md" | cut -d'|' -f2-3 | tr '\n' ' '; echo
done
tar czf "$OUT/r94.tgz" -C /tmp r94; ls -la "$OUT"
t end
