#!/usr/bin/env bash
# Session 22, call A, one GPU (nvidia-h200). ~8 min.
# The chunk kernel's tile order (grid_tile_width, grid_minor_dim) and
# delay_release (a wgmma left in flight across a pipeline step) against the
# config the kernel picks and XLA's dot, unflagged ("one") and flagged, on the
# per-device sizes (W = 4) of issue 6's shapes where the kernel trails cuBLAS
# most (session 17 call B); then the kernel tests on the GPU, new variants
# among them. Ran at e0ab802; delay_release was removed afterwards, so the
# dr variants now report an error (unknown key).
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r100; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
install_ficco
t tests
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_chunk_matmul.py -k "not interpreter" \
  > "$R/tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$R/tests.log"
t kernels
V=xla,one,one@w=4,one@w=8,one@w=16,one@minor=m+w=8,one@dr=1,one@dr=1+w=8
V=$V,flag/piece/piece_end,flag/piece/piece_end@w=8,flag/piece/piece_end@dr=1+w=8
timeout 400 python3 benchmarks/flag_kernel_bench.py --out_dir="$R" --tag=h200_s22a \
  --base=one --variants="$V" --rounds=7 \
  --shapes=square/16384x8192x8192,square/4096x8192x8192,llama3-8b/M4096,gpt3-175b/M8192,qwen2-72b/M8192,llama3-8b/M8192,llama3-70b/M8192 \
  > "$R/flag_kernel.log" 2>&1
echo "bench rc=$?"; grep -v "^I1\|^W1" "$R/flag_kernel.log" | tail -12
tar czf "$OUT/r100.tgz" -C /tmp r100; ls -la "$OUT"
t end
