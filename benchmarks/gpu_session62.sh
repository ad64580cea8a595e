#!/usr/bin/env bash
# Session 15, call A, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# Why host-bound reduce-scatters run slow whole rounds at a time:
#  1. the host's CPUs, NUMA nodes and each GPU's local CPUs;
#  2. host_timeline.py (handler timeline + per-thread scheduler counters,
#     24 rounds of 80 calls, ficco and XLA interleaved) at llama3-8b M4096
#     (4096x14336x4096) as shipped, without the dispatch marks, with the
#     issuers pinned near and far from their GPUs, with parallel issue, and
#     at square 4096 (4096x8192x8192); as shipped once more at the end;
#  3. the all-gather's llama3-8b M4096 candidates, interleaved (its cache
#     entry read 0.88x in session 14, call F).
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r62"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
t topology
{ lscpu; echo; nvidia-smi topo -m; echo; numactl -H 2>/dev/null; echo;
  for b in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader); do
    b=$(echo "$b" | tr 'A-F' 'a-f' | sed 's/^0000\(....\)/\1/')
    f=$(ls -d /sys/bus/pci/devices/*"${b#*:}" 2>/dev/null | head -1)
    echo "gpu $b local_cpulist $(cat "$f/local_cpulist" 2>/dev/null) numa $(cat "$f/numa_node" 2>/dev/null)"
  done; } > "$R/topology.txt" 2>&1
grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA|Model name|local_cpulist" "$R/topology.txt"
# Issuer CPUs: the 9th-12th CPU of the process's affinity ("near": the
# first NUMA node on these VMs) and the last four ("far").
read NEAR FAR < <(python3 -c "
import os; a = sorted(os.sched_getaffinity(0))
print(','.join(map(str, a[8:12])), ','.join(map(str, a[-4:])))")
echo "near=$NEAR far=$FAR"
install_ficco
TL="--schedules=default --rounds=24 --iters=80 --warmup=3"
L8="--m=4096 --k=14336 --n=4096"
run_tl() {  # name, env assignment (or -), then flags
  local name=$1 envs=$2; shift 2
  [ "$envs" = - ] && envs=FICCO_TL_VARIANT=$name
  t "timeline $name"
  env "$envs" timeout 150 python3 benchmarks/host_timeline.py $TL --variant="$name" \
    --out="$R/tl_$name.json" "$@" > "$R/tl_$name.log" 2>&1
  echo "rc=$?"; grep -E "^median|^ficco rounds|^XLA rounds" "$R/tl_$name.log"
}
run_tl l8_shipped   - $L8
run_tl l8_nomark    - $L8 --nomark
run_tl l8_pin_near  FICCO_ISSUER_CPUS=$NEAR $L8
run_tl l8_pin_far   FICCO_ISSUER_CPUS=$FAR $L8
run_tl l8_parallel  FICCO_CUDA_ISSUE=parallel $L8
run_tl sq4096       - --m=4096 --k=8192 --n=8192
run_tl l8_shipped2  - $L8
t ag
timeout 150 python3 benchmarks/stall_watch.py --out=/tmp/stall_ag.txt --stall_s=40 -- \
  benchmarks/ag_bench.py --axis_sizes=4 --peers= --models=llama3-8b --tokens=4096 --square=false \
  --schedules=default,none,ring/c1/dma/xla,direct/c1/dma/xla,bidirectional/c1/dma/xla,ring/c1/dma/pallas,direct/c1/dma/pallas \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=135 --out_dir="$R" --tag=w4_ag8b_s15a > "$R/ag.log" 2>&1
echo "ag rc=$?"; head -5 /tmp/stall_ag.txt 2>/dev/null
grep -E "^\|" "$R/ag_w4_ag8b_s15a.md" | cut -c1-250
ls "$R"
t end
