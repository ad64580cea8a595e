#!/usr/bin/env bash
# Issue 6's ten shapes as shipped (schedule=None), interleaved with XLA's
# program, on the 4-GPU machine (nvidia-h200-x4). ~5 min. Usage:
#   bash benchmarks/ten_shapes.sh NAME TAG
# writes /tmp/NAME/rs_w4_ten_TAG.{json,md} and $OUT/NAME.tgz. The caller's
# environment (e.g. FICCO_FLAGGED_TRANSPORT) reaches every child.
set -u
NAME=$1; TAG=$2
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/$NAME; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 290 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=260 --out_dir="$R" --tag=w4_ten_$TAG > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_$TAG.json"
tar czf "$OUT/$NAME.tgz" -C /tmp "$NAME"; ls -la "$OUT"
t end
