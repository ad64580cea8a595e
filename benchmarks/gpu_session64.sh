#!/usr/bin/env bash
# Session 15, call C, for the 4-GPU machine (nvidia-h200-x4). ~7 min.
#  1. issue 6's ten reduce-scatter shapes as shipped (schedule=None and
#     none, interleaved, 7 rounds);
#  2. host_timeline.py at llama3-8b M4096 (16 rounds of 80 calls, with the
#     trivial program as the host's speed): as shipped, issuers that never
#     spin (FICCO_ISSUER_SPIN_US=0), host waits that spin 30 us instead of
#     300 (FICCO_WAIT_SPIN_US=30), both; and square 4096 as shipped.
# Everything lands in one archive, $OUT/r64.tgz.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r64; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t rs
timeout 240 python3 benchmarks/stall_watch.py --out="$R/stall.txt" --stall_s=40 -- \
  benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none \
  --interleave --rounds=7 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=210 --out_dir="$R" --tag=w4_ten_s15c > "$R/rs.log" 2>&1
echo "rs rc=$?"; tail -2 "$R/rs.log"
python3 benchmarks/rs_summary.py "$R/rs_w4_ten_s15c.json"
L8="--m=4096 --k=14336 --n=4096"
run_tl() {  # name, env assignment, then flags
  local name=$1 envs=$2; shift 2
  t "timeline $name"
  env $envs timeout 120 python3 benchmarks/host_timeline.py --schedules=default --warmup=3 \
    --rounds=16 --iters=80 --variant="$name" --out="$R/tl_$name.json" "$@" > "$R/tl_$name.log" 2>&1
  echo "rc=$?"; grep -E "^median|^ficco rounds|Error" "$R/tl_$name.log" | head -4
}
run_tl l8_shipped    FICCO_TL=shipped $L8
run_tl l8_issuer0    FICCO_ISSUER_SPIN_US=0 $L8
run_tl l8_wait30     FICCO_WAIT_SPIN_US=30 $L8
run_tl l8_both       "FICCO_ISSUER_SPIN_US=0 FICCO_WAIT_SPIN_US=30" $L8
run_tl sq4096        FICCO_TL=shipped --m=4096 --k=8192 --n=8192
tar czf "$OUT/r64.tgz" -C /tmp r64; ls -la "$OUT"
t end
