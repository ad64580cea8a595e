#!/usr/bin/env bash
# Session 21, for the 2-GPU machine (nvidia-h200-x2). ~4 min.
# Push against the rendezvous transport for the flagged c1 reduce-scatter,
# interleaved in one process (host_bound_probe.py, "#push" labels), at the
# shapes where call C's separate runs disagreed with call B's, in two
# processes one after the other.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r98; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
L=direct/c1/dma/pallas/flagged
for n in 1 2; do
  t "process $n"
  timeout 150 python3 benchmarks/host_bound_probe.py \
    --cases=llama3-8b/M4096:4096x14336x4096,llama3-70b/M4096:4096x28672x8192,qwen2-72b/M4096:4096x29568x8192,gpt3-175b/M4096:4096x49152x12288,square/4096:4096x8192x8192 \
    --schedules=$L,$L#push --axis_sizes=2 --chain=0 --rounds=9 --iters=20 \
    --out_dir="$R" --tag=s21d_$n > "$R/probe_$n.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|direct)" "$R/host_bound_s21d_$n.md" | cut -d'|' -f2-5
done
tar czf "$OUT/r98.tgz" -C /tmp r98; ls -la "$OUT"
t end
