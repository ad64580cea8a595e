#!/usr/bin/env bash
# Session 4, call B on the 4-GPU machine (~4.5 min; run after call F): the
# reduce-scatter label sweep for issue 5 with the session-4 code (the sync
# call changed the copy-engine schedules' host cost): every model at
# M = 2048 (15 rounds: these ops are 0.15-1.5 ms and their medians are
# bimodal over 7) and M = 16384, the schedule families the heuristic returns.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/ficco_results19; rm -rf "$R"; mkdir -p "$R"
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
for spec in "2048 15 110" "16384 7 100"; do
  set -- $spec
  t "rs M=$1"
  timeout $(( $3 + 15 )) python3 benchmarks/rs_bench.py --axis_sizes=4 \
    --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=$1 --square=false \
    --schedules=none,direct/c1/dma,direct/c2/dma,ring/c1/dma,bidirectional/c1/dma \
    --interleave --rounds=$2 --iters=20 --time_budget_s=$3 --out_dir="$R" --tag=w4_sweep_m$1 \
    > "$R/rs_m$1.log" 2>&1; echo "rs rc=$?"
done
t end
tar -czf "$OUT/results19.tar.gz" -C "$R" .
for f in "$R"/*.md; do echo "== $f"; grep -E "^\|" "$f" | cut -c1-200; done
