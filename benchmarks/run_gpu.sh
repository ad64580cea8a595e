#!/usr/bin/env bash
# One command for the 4-GPU machine: install, record the machine, run every
# benchmark inside one time budget, plot, and leave a few files in $OUT.
#
#   bash benchmarks/run_gpu.sh            # TOTAL_S=520 by default
#   TOTAL_S=560 AG_SCHEDULES=all bash benchmarks/run_gpu.sh
#
# INSTALL=0 skips the pip install (uses the source tree; for CPU tests that
# must not touch the local site-packages).
# Steps (each gets a share of the time left when it starts; a soft budget that
# stops starting new cases/methods, and a hard `timeout` a little above it):
#   ag_bench W=4 (4 GPUs)  ag_bench W=2 (CUDA_VISIBLE_DEVICES=0,1, so Mosaic's
#   whole-mesh kernel runs too)  rs_bench W=4  torch_async_tp (torchrun, 4)
#   plot
# What comes back in $OUT (the device tool returns at most 8 files):
#   results.tar.gz   every JSON/MD the scripts wrote
#   all_results.json the same JSONs in one file, keyed by file name
#   summary.md, ag_speedup.png, rs_speedup.png, log.txt, env.txt
set -u

cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_out}
mkdir -p "$OUT"
RES=${RES:-/tmp/ficco_results}
# KEEP_RES=1 keeps what an earlier step of the same call wrote there.
[[ -n ${KEEP_RES:-} ]] || rm -rf "$RES"
mkdir -p "$RES"
LOG=$OUT/log.txt
: > "$LOG"

# NVLink multicast must stay off on these machines (it can take the host's
# shared GPUs out of service); every child process inherits these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PY:-python3}

TOTAL_S=${TOTAL_S:-520}          # Whole script, install included.
SLACK_S=${SLACK_S:-45}           # Hard timeout above each soft budget.
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
AG_SCHEDULES=${AG_SCHEDULES:-quick}
RS_SCHEDULES=${RS_SCHEDULES:-quick}
RS_COMMS=${RS_COMMS:-xla,dma}
# Cases in priority order (the budget cuts from the end). The first ones
# match /work/shared/reference/measurements.md.
AG_CASES=${AG_CASES:-8192x8192x28672,16384x8192x8192,4096x8192x8192,2048x8192x8192}
AG_MODELS=${AG_MODELS:-llama3-8b,llama3-405b,qwen2-72b,gpt3-175b,llama3-70b}
AG_TOKENS=${AG_TOKENS:-8192,4096}
RS_CASES=${RS_CASES:-8192x28672x8192,16384x8192x8192,4096x8192x8192}
RS_MODELS=${RS_MODELS:-llama3-8b,llama3-405b,llama3-70b}
RS_TOKENS=${RS_TOKENS:-8192,4096}
TORCH_MODELS=${TORCH_MODELS:-llama3-70b,llama3-8b,llama3-405b}
TORCH_TOKENS=${TORCH_TOKENS:-8192,4096,2048}
EXTRA_ARGS=${EXTRA_ARGS:-}        # Appended to the JAX benches (e.g. --rounds=3).
TORCH_EXTRA_ARGS=${TORCH_EXTRA_ARGS:-}
# Shares of the time left (ag4 ag2 rs4 torch).
W_AG4=${W_AG4:-45}; W_AG2=${W_AG2:-12}; W_RS4=${W_RS4:-25}; W_TORCH=${W_TORCH:-14}

log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

# share WEIGHT REMAINING_WEIGHTS -> soft budget (s) for the next step.
share() {
  local left=$((DEADLINE - $(date +%s) - 20))   # 20 s kept for plot + tar.
  local b=$(( left * $1 / $2 - SLACK_S ))
  (( b < 10 )) && b=10
  echo "$b"
}

run_step() {  # run_step NAME SOFT_BUDGET CMD...
  local name=$1 budget=$2; shift 2
  local hard=$((budget + SLACK_S))
  local left=$((DEADLINE - $(date +%s) - 15))
  (( hard > left )) && hard=$left
  if (( hard < 20 )); then log "SKIP $name: no time left"; return; fi
  log "START $name (soft ${budget}s, hard ${hard}s): $*"
  timeout --signal=TERM --kill-after=10 "$hard" "$@" >> "$LOG" 2>&1
  local rc=$?
  log "END $name rc=$rc$( ((rc == 124)) && echo ' (hit its hard timeout)')"
}

{
  echo "== date"; date -u
  echo "== nvidia-smi"; nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  echo "== topo"; nvidia-smi topo -m
  echo "== versions"
  $PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("jax", "jaxlib", "torch", "numpy", "absl", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
try:
    import torch
    print("cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
except Exception as e:
    print("torch cuda?", e)
EOF
  echo "== nvcc"; nvcc --version 2>&1 | tail -2
  echo "== env"; env | grep -E 'NCCL|NVSHMEM|TORCH_SYMM|XLA|CUDA' | sort
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$LOG" | head -40

INSTALL=${INSTALL:-1}            # 0: use the source tree (e.g. CPU tests).
if [[ $INSTALL == skip ]]; then
  log "INSTALL=skip: using the package installed earlier in this call"
elif [[ $INSTALL == 0 ]]; then
  log "INSTALL=0: using the source tree on PYTHONPATH"
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
elif log "pip install" && \
     $PY -m pip install --no-build-isolation --no-deps . >> "$LOG" 2>&1; then
  log "installed: $($PY -c 'import ficco_jax, os; print(ficco_jax.__file__)' 2>&1)"
else
  log "pip install FAILED; falling back to the source tree on PYTHONPATH"
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - >> "$LOG" 2>&1 <<'EOF'
import jax
print("jax devices:", jax.devices())
try:
    import ficco_jax
    from ficco_jax._src import heuristics
    print("ficco_jax", ficco_jax.__file__, "dma available:",
          heuristics.dma_available(jax.devices()[0].platform))
except Exception as e:
    print("ficco_jax check failed:", e)
EOF

B=$(share $W_AG4 $((W_AG4 + W_AG2 + W_RS4 + W_TORCH)))
run_step ag_w4 "$B" $PY benchmarks/ag_bench.py --axis_sizes=4 \
  --cases="$AG_CASES" --models="$AG_MODELS" --tokens="$AG_TOKENS" \
  --square=false --schedules="$AG_SCHEDULES" --peers=mosaic,torch \
  --out_dir="$RES" --tag=w4 --time_budget_s="$B" $EXTRA_ARGS

B=$(share $W_AG2 $((W_AG2 + W_RS4 + W_TORCH)))
CUDA_VISIBLE_DEVICES=0,1 run_step ag_w2 "$B" $PY benchmarks/ag_bench.py \
  --axis_sizes=2 --cases="$AG_CASES" --models=llama3-8b --tokens=8192 \
  --square=false --schedules="$AG_SCHEDULES" --peers=mosaic \
  --out_dir="$RES" --tag=w2 --time_budget_s="$B" $EXTRA_ARGS

B=$(share $W_RS4 $((W_RS4 + W_TORCH)))
run_step rs_w4 "$B" $PY benchmarks/rs_bench.py --axis_sizes=4 \
  --cases="$RS_CASES" --models="$RS_MODELS" --tokens="$RS_TOKENS" \
  --square=false --schedules="$RS_SCHEDULES" --comms="$RS_COMMS" \
  --out_dir="$RES" --tag=w4 --time_budget_s="$B" $EXTRA_ARGS

B=$(share $W_TORCH $W_TORCH)
run_step torch_w4 "$B" $PY -m torch.distributed.run --standalone \
  --nproc-per-node 4 benchmarks/torch_async_tp.py \
  --models="$TORCH_MODELS" --tokens="$TORCH_TOKENS" --square=1 \
  --out_dir="$RES" --tag=w4 --time_budget_s="$B" $TORCH_EXTRA_ARGS

log "plot"
$PY benchmarks/plot.py --results_dir="$RES" >> "$LOG" 2>&1 || log "plot failed"
cp "$RES"/summary.md "$RES"/*_speedup.png "$OUT"/ 2>/dev/null
$PY - "$RES" "$OUT/all_results.json" <<'EOF' >> "$LOG" 2>&1
import glob, json, os, sys
res, out = sys.argv[1], sys.argv[2]
data = {}
for p in sorted(glob.glob(os.path.join(res, "*.json"))):
    try:
        data[os.path.basename(p)] = json.load(open(p))
    except Exception as e:
        data[os.path.basename(p)] = {"unreadable": str(e)}
json.dump(data, open(out, "w"), indent=1)
EOF
tar -czf "$OUT/results.tar.gz" -C "$RES" . 2>> "$LOG"
log "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "================ summary.md"
cat "$OUT/summary.md" 2>/dev/null || echo "(no summary)"
