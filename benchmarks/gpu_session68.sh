#!/usr/bin/env bash
# Session 16, call A, for the 4-GPU machine (nvidia-h200-x4). ~8 min.
# The flagged granularity (one kernel and one start per op; the copies wait
# on the device for each piece's flag): its GPU tests, then issue 6's ten
# shapes with schedule=None (the cache, unchanged), flagged c1 and piece c1,
# interleaved in one process; one archive.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r68; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t tests
(cd /tmp && timeout 200 python3 -P -m pytest -q -x "$OLDPWD/tests/test_dma_protocol.py" "$OLDPWD/tests/test_ops.py" -k "flagged" \
  > "$R/pytest_flagged.txt" 2>&1); echo "pytest rc=$?"; tail -3 "$R/pytest_flagged.txt"
t rs
timeout 330 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,direct/c1/dma/pallas/flagged,direct/c1/dma/pallas \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=290 --out_dir="$R" --tag=w4_ten_s16a > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s16a.json"
tar czf "$OUT/r68.tgz" -C /tmp r68; ls -la "$OUT"
t end
