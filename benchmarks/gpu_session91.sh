#!/usr/bin/env bash
# Session 19, call H, for the 4-GPU machine (nvidia-h200-x4). ~3 min.
# Does issuing on XLA's threads (FICCO_CUDA_ISSUE=parallel: no issuer
# threads, half as many threads spinning per call) make llama3-8b M4096
# less sensitive to the host's slow state than async issue (the default)?
# Eight processes alternating async / parallel, as shipped otherwise.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r91; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
for n in 1 2 3 4; do
  for mode in async parallel; do
    t "$mode $n"
    FICCO_CUDA_ISSUE=$mode timeout 45 python3 benchmarks/host_bound_probe.py \
      --cases=llama3-8b/M4096:4096x14336x4096 --schedules=default --chain=0 \
      --rounds=7 --iters=20 --out_dir="$R" --tag=s19h_${mode}_$n > "$R/probe_${mode}_$n.log" 2>&1
    echo "rc=$?"; grep -E "^\| (xla|default) " "$R/host_bound_s19h_${mode}_$n.md" | cut -d'|' -f2-5 | tr '\n' ' '; echo
  done
done
tar czf "$OUT/r91.tgz" -C /tmp r91; ls -la "$OUT"
t end
