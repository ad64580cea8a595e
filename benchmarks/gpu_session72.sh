#!/usr/bin/env bash
# Session 17, call C, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# The flagged kernel's new walk and bump (call B: flags right on the GPU,
# kernel within noise of W launches) end to end: issue 6's ten shapes with
# schedule=None (the cache: flagged at llama3-8b M4096), flagged c1 and
# piece c1, interleaved in one process.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r72; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 330 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,direct/c1/dma/pallas/flagged,direct/c1/dma/pallas \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=280 --out_dir="$R" --tag=w4_ten_s17c > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s17c.json"
t tests
(cd /tmp && timeout 150 python3 -P -m pytest -q "$OLDPWD/tests/test_ops.py" -k "flagged" \
  > "$R/pytest_flagged.txt" 2>&1); echo "pytest rc=$?"; tail -2 "$R/pytest_flagged.txt"
tar czf "$OUT/r72.tgz" -C /tmp r72; ls -la "$OUT"
t end
