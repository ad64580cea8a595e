#!/usr/bin/env bash
# Session 6, call C on the 2-GPU machine (nvidia-h200-x2), ~8.5 min: labels
# of both ops at P = 2 for the heuristic-accuracy report (the shipped
# calibration applies at P = 4 only, so at P = 2 the component model ranks
# alone, every family eligible): every model at M = 2048 and 8192, the
# schedules the heuristic can return, 9 rounds of >= 25 ms, interleaved.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results33; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
for op in rs ag; do
  t $op
  timeout 250 python3 benchmarks/${op}_bench.py --axis_sizes=2 \
    --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=2048,8192 \
    --square=false --schedules=default,none,direct/c1/dma,direct/c2/dma,ring/c1/dma,ring/c2/dma,bidirectional/c1/dma \
    --peers= --interleave --rounds=9 --iters=20 --min_round_ms=25 --time_budget_s=225 \
    --out_dir="$R" --tag=w2_labels > "$R/$op.log" 2>&1
  echo "$op rc=$?"; grep -E "^\|" "$R/${op}_w2_labels.md" | cut -c1-220
done
t end
tar -czf "$OUT/results33.tar.gz" -C "$R" .
