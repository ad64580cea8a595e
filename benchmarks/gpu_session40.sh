#!/usr/bin/env bash
# Session 8, call D, for the 4-GPU machine (nvidia-h200-x4). ~9 min (call C stopped at
# its tests: a half-depth last step inside the kernel needs a GMEM operand
# whose K Mosaic GPU can tile; this call pads h instead):
#  1. the Pallas kernel tests on the GPU, among them a zero-padded x for K with a half
#     step over (qwen2-72b: 7392 = 115.5 x 64); stops here if they fail;
#  2. issue 6's ten reduce-scatter shapes (session 7 call C's schedules):
#     qwen2-72b's pieces now take the Pallas kernel at full depth on h zero-padded to 7424 columns;
#  3. qwen2-72b alone with more Pallas schedules, a second run for the
#     cache's worst-over-runs rule.
set -u
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/r40"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t install; python3 -m pip install --no-build-isolation --no-deps . > "$R/install.log" 2>&1 || echo "install FAILED"
t pytest
timeout 150 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_pallas_chunk_matmul.py tests/test_ops.py -k "pad or pallas" \
  > "$R/pytest_pallas_gpu.txt" 2>&1
rc=$?; echo "pytest rc=$rc"; tail -3 "$R/pytest_pallas_gpu.txt"
if [ $rc -ne 0 ]; then grep -E "^E |Error" "$R/pytest_pallas_gpu.txt" | head -20; exit 1; fi
t rs
timeout 270 python3 benchmarks/rs_bench.py --axis_sizes=4 \
  --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192 --square=true \
  --schedules=default,none,direct/c1/dma,direct/c1/dma/pallas,direct/c2/dma/pallas/step,ring/c1/dma \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=250 --out_dir="$R" --tag=w4_issue6_s8d > "$R/rs.log" 2>&1
echo "rs rc=$?"; grep -E "^\|" "$R/rs_w4_issue6_s8d.md" | cut -c1-250
t qwen
timeout 110 python3 benchmarks/rs_bench.py --axis_sizes=4 --models=qwen2-72b --tokens=4096,8192 \
  --schedules=none,direct/c1/dma,direct/c1/dma/pallas,direct/c2/dma/pallas,direct/c1/dma/pallas/step,direct/c2/dma/pallas/step,ring/c1/dma/pallas \
  --interleave --rounds=9 --iters=20 --min_round_ms=25 --settle_ms=10 --order=shuffle \
  --time_budget_s=100 --out_dir="$R" --tag=w4_qwen_s8d > "$R/rs_qwen.log" 2>&1
echo "qwen rc=$?"; grep -E "^\|" "$R/rs_w4_qwen_s8d.md" | cut -c1-250
python3 - "$R" <<'PY'
import json, sys
for tag in ("w4_issue6_s8d", "w4_qwen_s8d"):
  try:
    d = json.load(open(f"{sys.argv[1]}/rs_{tag}.json"))
  except Exception as e:
    print(tag, "no json", e); continue
  for c in d["cases"]:
    print(tag, c["name"], " ".join(
        f"{m['label']}={m.get('speedup_vs_xla') or 0:.3f}" for m in c["methods"]))
PY
ls "$R"
t end
