#!/usr/bin/env bash
# Session 18, call F, for the 4-GPU machine (nvidia-h200-x4). ~3 min.
# Does the host's thread placement decide the host-sensitive shapes? Four
# processes in turn, threads left to the scheduler / pinned one per core of
# the first NUMA node (host_bound_probe.py --pin=cores: Python's main
# thread, XLA's execute threads, ficco's issuers, CUDA's event handler):
# llama3-8b M4096 and square 4096, XLA / as shipped / piece c1, per call.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r82; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
{ nproc; for n in /sys/devices/system/node/node*; do echo "$n: $(cat $n/cpulist)"; done
  for c in 0 1 2 31 32 33 63; do echo "cpu$c siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"; done
  nvidia-smi topo -m; } > "$R/topology.txt" 2>&1
head -12 "$R/topology.txt"
install_ficco
for i in 1 2; do
  for pin in none cores; do
    t "probe $pin $i"
    timeout 100 python3 benchmarks/host_bound_probe.py \
      --cases=llama3-8b/M4096:4096x14336x4096,square/4096:4096x8192x8192 \
      --schedules=default,direct/c1/dma/pallas --chain=0 --pin=$pin \
      --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
      --out_dir="$R" --tag=s18f_${pin}_$i > "$R/probe_${pin}_$i.log" 2>&1
    echo "rc=$?"
    python3 benchmarks/host_bound_probe_summary.py "$R/host_bound_s18f_${pin}_$i.json" | tail -4
  done
done
tar czf "$OUT/r82.tgz" -C /tmp r82; ls -la "$OUT"
t end
