#!/usr/bin/env bash
# Session 17, call F, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# The flagged kernel after call E's profile (its kernel ran 15-18% longer
# beside the copies than alone: one system-scope release per tile): one
# bump per CTA and piece. GPU tests of the flagged op first, then issue 6's
# ten shapes: schedule=None, flagged c1, piece c1, interleaved.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r75; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t tests
(cd /tmp && timeout 150 python3 -P -m pytest -q "$OLDPWD/tests/test_ops.py" -k "flagged" \
  > "$R/pytest_flagged.txt" 2>&1); echo "pytest rc=$?"; tail -2 "$R/pytest_flagged.txt"
t rs
timeout 280 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,direct/c1/dma/pallas/flagged,direct/c1/dma/pallas \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=230 --out_dir="$R" --tag=w4_ten_s17f > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s17f.json"
tar czf "$OUT/r75.tgz" -C /tmp r75; ls -la "$OUT"
t end
