#!/usr/bin/env bash
# For the 4-GPU machine (nvidia-h200-x4), written in session 6 when that kind
# was withheld; ran as session 6 call C (rs) / D (ag). ~6 min: issue 5's labels of the rs op
# re-measured on the current protocol (session 5's copy path) with rounds
# stretched to >= 25 ms: every model at M = 2048, 4096, 8192 and 16384 plus
# the squares, the schedules the heuristic can return. Then, on a CPU:
#   python3 benchmarks/heuristic_accuracy.py --latest_only --stat=median_ms \
#     --results=<the session-4/5 inputs>,<this file> ...
# (benchmarks/README.md, "Accuracy reports").
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r31"; rm -rf "$R"; mkdir -p "$R"  # straight into $OUT: a cut call still returns its files
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t rs
timeout 470 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b,llama3-405b --tokens=2048,4096,8192,16384 \
  --square=true --schedules=none,direct/c1/dma,direct/c2/dma,direct/c1/dma/xla/step,direct/c2/dma/xla/step,ring/c1/dma,bidirectional/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --time_budget_s=420 --out_dir="$R" \
  --tag=w4_labels > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_labels.md" | cut -c1-200
t end
