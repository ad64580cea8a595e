#!/usr/bin/env bash
# Session 19, call G, for the 4-GPU machine (nvidia-h200-x4). ~4 min.
# The final tree's per-process spread at the two host-bound shapes: eight
# processes in turn, each timing XLA's program and ficco as shipped per
# call (host_bound_probe.py, 7 interleaved rounds) at llama3-8b M4096 and
# square 4096. Session 18 call G and this session's call A found single
# processes where ficco read below XLA at llama3-8b M4096 (older trees).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r90; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
for n in 1 2 3 4 5 6 7 8; do
  t "process $n"
  timeout 60 python3 benchmarks/host_bound_probe.py \
    --cases=llama3-8b/M4096:4096x14336x4096,square/4096:4096x8192x8192 \
    --schedules=default --chain=0 --rounds=7 --iters=20 \
    --out_dir="$R" --tag=s19g_$n > "$R/probe_$n.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|default) " "$R/host_bound_s19g_$n.md" | cut -d'|' -f2-5 | tr '\n' ' '; echo
done
tar czf "$OUT/r90.tgz" -C /tmp r90; ls -la "$OUT"
t end
