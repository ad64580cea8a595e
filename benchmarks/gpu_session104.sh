#!/usr/bin/env bash
# Session 22, call J, the 4-GPU machine (nvidia-h200-x4). ~3 min.
# The push sum with its loads unrolled per peer count (cuda_push_sum.cu;
# call I: 22.2 us against XLA's 19.5 for the rendezvous path's sum at
# square 4096): the flagged GPU tests (push bit-equal to the rendezvous
# path among them), the op's profile over push, and square 4096 / llama3-8b
# M4096 as shipped against #rendezvous in one process.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r104; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
flagged_gpu_tests "$R"
t profile
timeout 100 python3 benchmarks/host_profile.py \
  --cases=square/4096:4096x8192x8192 --schedules=default --axis_sizes=4 --calls=50 \
  --out_dir="$R" --tag=s22j_push > "$R/profile_push.log" 2>&1
echo "rc=$?"
t pair
timeout 60 python3 benchmarks/host_bound_probe.py \
  --cases=llama3-8b/M4096:4096x14336x4096,square/4096:4096x8192x8192 \
  --schedules=default,default#rendezvous --axis_sizes=4 --chain=0 --rounds=7 --iters=20 \
  --out_dir="$R" --tag=s22j > "$R/probe.log" 2>&1
echo "rc=$?"; grep -E "^\| (xla|trivial|default)" "$R/host_bound_s22j.md" | cut -d'|' -f2-5 | tr '\n' ' '; echo
grep -A 6 "GPU:0 stream \`Stream #50" "$R/host_profile_s22j_push.md" | tail -4
tar czf "$OUT/r104.tgz" -C /tmp r104; ls -la "$OUT"
t end
