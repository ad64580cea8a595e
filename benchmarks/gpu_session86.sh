#!/usr/bin/env bash
# Session 19, call C, for the 4-GPU machine (nvidia-h200-x4). ~6 min.
# A/B of the session-19 flagged changes on the two host-bound shapes, in
# processes that alternate: this tree ("new": the arm writes the rank, so
# no partition-id and convert in the program; one copy queue per device)
# against the build of commit 7a6612c ("old", from ab_old_7a6612c.tgz, an
# untracked `git archive` carried with the tree, made by
#   git archive 7a6612c -- . ':!benchmarks' ':!tests' ':!examples' \
#     | gzip > ab_old_7a6612c.tgz
# and deleted after the run), and this tree with
# FICCO_FLAGGED_RANK=axis_index (the rank from XLA again: what the arm's
# rank alone is worth). Then the new flagged program's compiled HLO.
# Since e0ab802 (session 22) the flagged default is push, where
# FICCO_FLAGGED_RANK is an error: run this with FICCO_FLAGGED_TRANSPORT=rendezvous.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r86; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import jax; print('jax', jax.__version__)"
install_ficco
t "install old"
rm -rf /tmp/ab_old /tmp/old_site; mkdir -p /tmp/ab_old
tar xzf ab_old_7a6612c.tgz -C /tmp/ab_old
python3 -m pip install --no-build-isolation --no-deps --target /tmp/old_site /tmp/ab_old > /tmp/install_old.log 2>&1 || { echo "old install FAILED"; tail -20 /tmp/install_old.log; exit 1; }
PYTHONPATH=/tmp/old_site python3 -c "import ficco_jax; print('old at', ficco_jax.__file__)"
python3 -c "import ficco_jax; print('new at', ficco_jax.__file__)"
CASES=llama3-8b/M4096:4096x14336x4096,square/4096:4096x8192x8192
probe() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout 80 python3 benchmarks/host_bound_probe.py --cases=$CASES \
    --schedules=default --chain=0 --rounds=7 --iters=20 \
    --out_dir="$R" --tag=$tag > "$R/probe_$tag.log" 2>&1
  echo "rc=$?"; grep -E "^## |^\| (xla|default) " "$R/host_bound_$tag.md" | cut -d'|' -f1-5
}
for n in 1 2 3; do
  t "new $n"; probe s19c_new_$n X=1
  t "old $n"; probe s19c_old_$n PYTHONPATH=/tmp/old_site
  t "new, rank from axis_index $n"; probe s19c_axisrank_$n FICCO_FLAGGED_RANK=axis_index
done
t hlo
python3 - > "$R/hlo_counts.txt" 2>&1 <<'PY'
import functools, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P, NamedSharding as NS
import ficco_jax
mesh = jax.make_mesh((4,), ("x",))
for label in ("direct/c1/dma/pallas/flagged",):
  op = functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                         schedule=ficco_jax.Schedule.from_short(label))
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                            out_specs=P("x", None), check_vma=False))
  a = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16, sharding=NS(mesh, P(None, "x")))
  b = jax.ShapeDtypeStruct((14336, 4096), jnp.bfloat16, sharding=NS(mesh, P("x", None)))
  text = f.lower(a, b).compile().as_text()
  print(label)
  for key in ("partition-id", "fusion(", "custom-call(", "convert("):
    print(" ", key, text.count(key))
  print(text[text.find("ENTRY"):][:4000])
PY
head -8 "$R/hlo_counts.txt"
tar czf "$OUT/r86.tgz" -C /tmp r86; ls -la "$OUT"
t end
