"""Host floor of the copy-engine schedules: where a host-bound op's time goes.

On a shape whose device work is tiny (default 512 x 4096 x 4096, bf16), an
op takes as long as the host needs to issue it. Per op and schedule this
times XLA's program and ficco's (interleaved, medians over rounds), then
runs ``--stats_calls`` more calls with the peer-copy handlers' own host
counters (`library.host_stats`: no profiler, which inflates every CUDA
call) and reports them per device and call: whole starts, their wait for
the peers to publish, their copy issue, whole syncs, and the stream waits
syncs enqueue. A label's ``@mode`` suffix (``direct/c1/dma@parallel``)
selects the peer-copy issue mode (PROTOCOL.md); with async issue the wait
and the issue happen on the devices' issuer threads, so "start" is what
XLA's thread spends.

  python benchmarks/host_floor.py --ops=rs,ag --m=512 --k=4096 --n=4096 \
      --schedules=direct/c1/dma,ring/c1/dma --rounds=7 --iters=50 \
      --out=host_floor.json
"""

from __future__ import annotations

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
# --schedules (labels), --rounds, --iters, --warmup: common's flags.
common.define_flags(default_peers="")
_OPS = flags.DEFINE_list("ops", ["rs", "ag"], "rs and/or ag.")
_M = flags.DEFINE_integer("m", 512, "Global rows M.")
_K = flags.DEFINE_integer("k", 4096, "Global K.")
_N = flags.DEFINE_integer("n", 4096, "Global N.")
_W = flags.DEFINE_integer("axis_size", 4, "Devices on the axis.")
_STATS_CALLS = flags.DEFINE_integer("stats_calls", 200,
                                    "Calls measured by the host counters.")
_OUT = flags.DEFINE_string("out", "host_floor.json", "JSON output path.")


def _case(op: str, mesh, w: int):
  """(xla body, ficco op, in_specs, out_spec, args) of one op."""
  from jax import lax
  from jax.sharding import PartitionSpec as P
  import ficco_jax

  m, k, n = _M.value, _K.value, _N.value
  if op == "rs":
    in_specs, out_spec = common.rs_specs()
    args = (common.random_array(mesh, (m, k), in_specs[0], 1),
            common.random_array(mesh, (k, n), in_specs[1], 2))
    return (common.xla_rs, ficco_jax.matmul_reduce_scatter, in_specs,
            out_spec, args)
  args = (common.random_array(mesh, (m, k), P("x", None), 1),
          common.random_array(mesh, (k, n), P(None, "x"), 2))
  body = lambda a, b: lax.all_gather(a, "x", axis=0, tiled=True) @ b
  return (body, ficco_jax.all_gather_matmul,
          (P("x", None), P(None, "x")), P(None, "x"), args)


def _stats_per_call(fn, args, calls: int, devices: int) -> dict:
  import jax
  from ficco_jax._src.dma import library

  platform = "cuda" if jax.devices()[0].platform == "gpu" else "cpu"
  jax.block_until_ready(fn(*args))
  library.reset_host_stats(platform)
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  out = {}
  for name, (n, s) in library.host_stats(platform).items():
    out[name] = {"per_call": n / (calls * devices),
                 "us_per_call": 1e6 * s / (calls * devices)}
  return out


def main(argv):
  del argv
  import jax

  timing.set_min_round_ms(FLAGS.min_round_ms)
  w = _W.value
  mesh = common.mesh_of(w)
  results = {"env": common.env_info("host_floor"), "shape": [_M.value,
             _K.value, _N.value], "axis_size": w, "cases": []}
  entries = []
  with timing.interleaved(True):
    for op in _OPS.value:
      body, op_fn, in_specs, out_spec, args = _case(op, mesh, w)
      tk = dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)
      xla = common.jit_shard_map(body, mesh, in_specs, out_spec)
      trivial = common.trivial_program(mesh, in_specs)
      rec = {"op": op, "xla": timing.time_jax(xla, [args], **tk),
             "trivial": timing.time_jax(trivial, [args], **tk), "ficco": {}}
      for label in FLAGS.schedules:
        # "label@mode": the schedule under that peer-copy issue mode.
        sched = common.schedule_from_label(label.partition("@")[0])
        fn = common.with_issue_mode(common.jit_shard_map(
            functools.partial(op_fn, axis_name="x", schedule=sched), mesh,
            in_specs, out_spec), label)
        rec["ficco"][label] = {"time": timing.time_jax(fn, [args], **tk)}
        entries.append((rec["ficco"][label], fn, args))
      results["cases"].append(rec)
  for entry, fn, args in entries:
    entry["host"] = _stats_per_call(fn, args, _STATS_CALLS.value, w)
  lines = [f"# Host floor, {_M.value}x{_K.value}x{_N.value} bf16, W={w}",
           f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", "",
           "| op | schedule | ms | vs XLA | start us (n) | rendezvous us |"
           " issue us | sync us (n) | stream waits per sync call |",
           "|---|---|---|---|---|---|---|---|---|"]
  for rec in results["cases"]:
    x = rec["xla"]["median_ms"]
    lines.append(f"| {rec['op']} | xla | {x:.3f} | 1.00x | | | | | |")
    tr = rec["trivial"]["median_ms"]
    lines.append(f"| {rec['op']} | trivial (a * 2) | {tr:.3f} | {x / tr:.2f}x"
                 " | | | | | |")
    for label, e in rec["ficco"].items():
      t, h = e["time"]["median_ms"], e["host"]
      waits = h["sync_waits"]["per_call"] / max(h["sync"]["per_call"], 1e-9)
      lines.append(
          f"| {rec['op']} | {label} | {t:.3f} | {x / t:.2f}x |"
          f" {h['start']['us_per_call']:.1f} ({h['start']['per_call']:.0f}) |"
          f" {h['start_rendezvous']['us_per_call']:.1f} |"
          f" {h['start_issue']['us_per_call']:.1f} |"
          f" {h['sync']['us_per_call']:.1f} ({h['sync']['per_call']:.0f}) |"
          f" {waits:.1f} |")
  md = "\n".join(lines)
  print(md)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1, default=str)
  with open(os.path.splitext(_OUT.value)[0] + ".md", "w") as f:
    f.write(md + "\n")


if __name__ == "__main__":
  app.run(main)
