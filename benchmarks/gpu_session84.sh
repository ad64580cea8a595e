#!/usr/bin/env bash
# Session 19, call A, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# The per-process state at llama3-8b M4096 (session 18, call G): six
# processes in turn, each timing XLA's, the trivial and ficco's program per
# call and recording each under jax's profiler (host_profile.py), so the
# slow and the fast processes can be compared event by event; then four
# processes with CUDA_DEVICE_MAX_CONNECTIONS=32 (host_bound_probe.py).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r84; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
CASE=llama3-8b/M4096:4096x14336x4096
for n in 1 2 3 4 5 6; do
  t "profile $n"
  timeout 90 python3 benchmarks/host_profile.py --cases=$CASE \
    --schedules=default --calls=200 --rounds=7 --iters=20 \
    --out_dir="$R" --tag=s19a_$n > "$R/profile_$n.log" 2>&1
  echo "rc=$?"; grep -E "^### " "$R/host_profile_s19a_$n.md"
done
for n in 1 2 3 4; do
  t "connections=32 $n"
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 60 python3 benchmarks/host_bound_probe.py \
    --cases=$CASE --schedules=default --chain=0 \
    --rounds=7 --iters=20 --out_dir="$R" --tag=s19a_conn32_$n > "$R/probe_conn32_$n.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|default|trivial)" "$R/host_bound_s19a_conn32_$n.md" | cut -d'|' -f2-5
done
tar czf "$OUT/r84.tgz" -C /tmp r84; ls -la "$OUT"
t end
