#!/usr/bin/env bash
# Session 13, call A (second part), for the 4-GPU machine (nvidia-h200-x4).
# ~1 min. The compiled HLO of direct/c1/dma/pallas at 512x4096x4096 and
# deeper host timelines (7 levels) of piece and step at that size; its
# outputs are in results/h200x4_session13_a (hlo_counts.txt,
# profile_timeline_{0,1}.txt).
set -u
source benchmarks/gpu_env.sh
R="$OUT/r53b"; rm -rf "$R"; mkdir -p "$R"
python3 -m pip install --no-build-isolation --no-deps . > /tmp/install.log 2>&1 || exit 1
timeout 60 python3 benchmarks/hlo_dump.py --m=512 --k=4096 --n=4096 --schedule=direct/c1/dma/pallas --out="$R/rs_512.hlo.txt" > "$R/hlo_counts.txt" 2>/tmp/hlo.log; echo hlo rc=$?
timeout 100 python3 benchmarks/profile_ops.py --calls=10 --host_timeline --out_dir="$R" \
  --specs=rs:512x4096x4096:direct/c1/dma/pallas,rs:512x4096x4096:direct/c1/dma/pallas/step > /tmp/prof.log 2>&1; echo prof rc=$?
ls $R
