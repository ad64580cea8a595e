"""A collective matmul in one process or one process per GPU(s), side by side.

Issue 7's table: the same cases and schedules timed with every GPU in one
process (the copy-engine path may use either transport) and with the GPUs
split over processes (python -m ficco_jax.launch; only the window transport
reaches peers in other processes). Each run writes one JSON + markdown file;
the baseline of every row is XLA's all_gather + dot (schedule "none")
measured in the same run, and every ficco output is checked against it.

  python3 benchmarks/mp_ag_bench.py --transports=rendezvous,window --tag=sp
  python3 -m ficco_jax.launch -n 4 benchmarks/mp_ag_bench.py --tag=mp4x1
  python3 -m ficco_jax.launch -n 2 benchmarks/mp_ag_bench.py --tag=mp2x2

``--op=rs`` times matmul_reduce_scatter instead (baseline: XLA's dot +
psum_scatter); its schedules may name a compute granularity, e.g.
``direct:1:dma:pallas:flagged`` (in a job of several processes the flagged
pieces travel over the push protocol).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ficco_jax import launch  # noqa: E402

if "FICCO_COORDINATOR" in os.environ:  # Started by ficco_jax.launch.
  launch.initialize_from_env()

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ficco_jax  # noqa: E402
from ficco_jax import Schedule  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["16384x8192x8192", "8192x8192x28672",
                            "4096x8192x8192"], "Global MxKxN (x [M, K]).")
flags.DEFINE_list("schedules", ["ring:1:dma", "direct:1:dma",
                                "bidirectional:1:dma", "ring:1:xla"],
                  "dataflow:chunks:comm[:compute[:granularity]]; 'none' is"
                  " the baseline.")
flags.DEFINE_enum("op", "ag", ["ag", "rs"],
                  "all_gather_matmul or matmul_reduce_scatter.")
flags.DEFINE_list("transports", ["auto"],
                  "FICCO_DMA_TRANSPORT values to time dma schedules with.")
flags.DEFINE_integer("rounds", 5, "Timed rounds.")
flags.DEFINE_integer("iters", 10, "Back-to-back calls per round.")
flags.DEFINE_string("out_dir", os.path.join(HERE, "results"), "Output folder.")
flags.DEFINE_string("tag", "sp", "File tag.")


def _schedule(label: str) -> Schedule:
  if label == "none":
    return Schedule(dataflow="none")
  parts = label.split(":")
  kw = dict(dataflow=parts[0], num_chunks=int(parts[1]), comm=parts[2])
  if len(parts) > 3:
    kw["compute"] = parts[3]
  if len(parts) > 4:
    kw["compute_granularity"] = parts[4]
  return Schedule(**kw)


def _global(mesh, spec, a):
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                      lambda idx: a[idx])


def _local(out) -> np.ndarray:
  return np.concatenate([np.asarray(s.data, np.float32).ravel()
                         for s in sorted(out.addressable_shards,
                                         key=lambda s: s.device.id)])


def main(argv):
  del argv
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  p = mesh.size
  layout = (f"{jax.process_count()} process(es) x {jax.local_device_count()}"
            f" GPU(s)")
  rows = []
  for case in FLAGS.cases:
    m, k, n = (int(v) for v in case.split("x"))
    rng = np.random.default_rng(0)  # The same data in every process.
    x = rng.standard_normal((m, k), np.float32).astype(jnp.bfloat16)
    w = (rng.standard_normal((k, n), np.float32) / np.sqrt(k)).astype(
        jnp.bfloat16)
    # all-gather: x rows sharded, w columns; reduce-scatter: K sharded.
    op, specs = ((ficco_jax.all_gather_matmul,
                  (P("x"), P(None, "x"), P(None, "x"))) if FLAGS.op == "ag"
                 else (ficco_jax.matmul_reduce_scatter,
                       (P(None, "x"), P("x"), P("x"))))
    args = [(_global(mesh, specs[0], x), _global(mesh, specs[1], w))]
    runs = [("none", "-")]
    for label in FLAGS.schedules:
      if label == "none":
        continue
      for t in (FLAGS.transports if ":dma" in label else ["-"]):
        runs.append((label, t))
    ref = None
    for label, transport in runs:
      if transport != "-":
        os.environ["FICCO_DMA_TRANSPORT"] = transport
        jax.clear_caches()  # The transport is read when lowering.
      f = jax.jit(jax.shard_map(
          functools.partial(op, axis_name="x", schedule=_schedule(label)),
          mesh=mesh, in_specs=specs[:2], out_specs=specs[2]))
      row = {"case": case, "schedule": label, "transport": transport}
      try:
        out = _local(f(*args[0]))
        if ref is None:
          ref = out
        row["rel_err_vs_none"] = float(np.linalg.norm(out - ref) /
                                       np.linalg.norm(ref))
        row.update(timing.time_jax(f, args, rounds=FLAGS.rounds,
                                   iters=FLAGS.iters))
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = str(e)[:800]
      rows.append(row)
      if jax.process_index() == 0:
        print(json.dumps({k2: v for k2, v in row.items()
                          if k2 != "rounds_ms"}), flush=True)
  if jax.process_index() != 0:
    return
  base = {r["case"]: r.get("median_ms") for r in rows if r["schedule"] == "none"}
  for r in rows:
    if r.get("median_ms") and base.get(r["case"]):
      r["speedup_vs_none"] = base[r["case"]] / r["median_ms"]
  meta = {
      "command": " ".join([sys.executable] + sys.argv),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "jax": jax.__version__, "device_kind": jax.devices()[0].device_kind,
      "layout": layout, "axis_size": p, "rounds": FLAGS.rounds,
      "iters": FLAGS.iters, "dtype": "bfloat16", "op": FLAGS.op,
      "env": {k2: v for k2, v in os.environ.items()
              if k2.startswith("FICCO_") and k2 != "FICCO_COORDINATOR"},
      "stat": "median over rounds of round_time/iters (timing.py)"}
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  path = os.path.join(FLAGS.out_dir, f"mp_{FLAGS.op}_{FLAGS.tag}")
  with open(path + ".json", "w") as fh:
    json.dump({"meta": meta, "rows": rows}, fh, indent=1)
  name = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}[FLAGS.op]
  lines = [f"# {name}, {layout}", "",
           f"- command: `{meta['command']}`",
           f"- device: {meta['device_kind']} x {p}, jax {meta['jax']}", "",
           "| case | schedule | transport | median ms | vs none | rel err |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['case']} | {r['schedule']} | {r['transport']} |"
                   f" error: {r['error'][:80]} | | |")
      continue
    lines.append(
        f"| {r['case']} | {r['schedule']} | {r['transport']} |"
        f" {r['median_ms']:.3f} | {r.get('speedup_vs_none', 1.0):.2f}x |"
        f" {r['rel_err_vs_none']:.1e} |")
  with open(path + ".md", "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  app.run(main)
