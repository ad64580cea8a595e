#!/usr/bin/env bash
# Session 15, call E, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# As shipped at the end of session 15 (llama3-8b M4096's reduce-scatter on
# halving again, the host timeline and GPU stamps compiled in but off):
# issue 6's ten reduce-scatter shapes, schedule=None and none, interleaved,
# 7 rounds. One archive, $OUT/r66.tgz.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r66; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 240 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=210 --out_dir="$R" --tag=w4_ten_s15e > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s15e.json"
tar czf "$OUT/r66.tgz" -C /tmp r66; ls -la "$OUT"
t end
