#!/usr/bin/env bash
# Session 18, call G, for the 4-GPU machine (nvidia-h200-x4). ~3 min.
# Which threads' placement matters at llama3-8b M4096 (call F: pinning all
# busy threads made ficco 5-9% faster)? One process per variant, in turn:
# nothing pinned, all, XLA's 4 execute threads, Python's main thread,
# ficco's issuers, main + XLA, then nothing and all again
# (host_bound_probe.py --pin).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r83; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
n=0
for pin in none cores xla main issuers main,xla none cores; do
  n=$((n + 1)); tag="s18g_${n}_$(echo $pin | tr , +)"
  t "probe $pin"
  timeout 60 python3 benchmarks/host_bound_probe.py \
    --cases=llama3-8b/M4096:4096x14336x4096 \
    --schedules=default,direct/c1/dma/pallas --chain=0 \
    $( [ "$pin" = none ] || echo "--pin=$pin" ) \
    --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
    --out_dir="$R" --tag=$tag > "$R/probe_$tag.log" 2>&1
  echo "rc=$?"; grep -E "^\| (xla|default|direct)" "$R/host_bound_$tag.md" | cut -d'|' -f2-5
done
tar czf "$OUT/r83.tgz" -C /tmp r83; ls -la "$OUT"
t end
