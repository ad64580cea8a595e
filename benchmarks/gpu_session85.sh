#!/usr/bin/env bash
# Session 19, call B, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# Is the per-process state of the host-bound shapes the wake-up latency of
# idle vCPUs (Firecracker: a halted vCPU costs a VM exit to wake)? The
# machine's idle setup, then host_bound_probe.py at llama3-8b M4096 and
# square 4096 in processes run one after another: as the machine is (3),
# with every vCPU kept from halting by SCHED_IDLE spinners (3; they yield
# to any normal thread at once), as is again (2). A diagnosis of the host,
# not a library change.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r85; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
{
  echo "nproc $(nproc)"; uname -r
  for f in /sys/devices/system/cpu/cpuidle/current_driver \
           /sys/devices/system/cpu/cpuidle/current_governor \
           /sys/devices/system/cpu/cpuidle/current_governor_ro \
           /sys/module/haltpoll/parameters/* /sys/module/cpuidle_haltpoll/parameters/* \
           /proc/sys/kernel/sched_*; do
    [ -r "$f" ] && echo "$f: $(cat $f 2>/dev/null | head -1)"
  done
  for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do
    [ -d "$s" ] && echo "$s: $(cat $s/name) latency=$(cat $s/latency) usage=$(cat $s/usage) disable=$(cat $s/disable)"
  done
  grep -m1 "model name" /proc/cpuinfo; grep -c processor /proc/cpuinfo
  cat /proc/cmdline
} > "$R/host_idle.txt" 2>&1
cat "$R/host_idle.txt"
install_ficco
probe() {  # tag
  timeout 80 python3 benchmarks/host_bound_probe.py \
    --cases=llama3-8b/M4096:4096x14336x4096,square/4096:4096x4096x4096 \
    --schedules=default --chain=0 --rounds=7 --iters=20 \
    --out_dir="$R" --tag=$1 > "$R/probe_$1.log" 2>&1
  echo "rc=$?"; grep -E "^## |^\| (xla|default|trivial) " "$R/host_bound_$1.md" | cut -d'|' -f1-5
}
for n in 1 2 3; do t "as is $n"; probe s19b_asis_$n; done
N=$(nproc)
PIDS=""
for i in $(seq 1 $N); do chrt -i 0 sh -c 'while :; do :; done' & PIDS="$PIDS $!"; done
sleep 1
for n in 1 2 3; do t "spinners $n"; probe s19b_spin_$n; done
kill $PIDS; wait 2>/dev/null
for n in 4 5; do t "as is $n"; probe s19b_asis_$n; done
tar czf "$OUT/r85.tgz" -C /tmp r85; ls -la "$OUT"
t end
