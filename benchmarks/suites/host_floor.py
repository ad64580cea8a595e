"""Suite ``host-floor``: where a host-bound op's time goes.

On a shape whose device work is tiny (default 512 x 4096 x 4096, bf16) an op
takes as long as the host needs to issue it. Per op (``--ops``) this times
XLA's program, a trivial program (dispatch and one element-wise kernel per
device, no collective: the host's own floor) and ficco's ``--schedules``,
interleaved; then runs ``--stats_calls`` more calls of each ficco schedule
with the peer-copy handlers' own host counters
(``ficco_jax._src.dma.library.host_stats``, no profiler: a profiler inflates
every CUDA call) and reports them per device and call: whole starts, their
wait for the peers, their copy issue, whole syncs, and the stream waits the
syncs enqueue. Schedules without copy-engine ops have no counters.
"""

from __future__ import annotations

from absl import flags

from lib import cases as cases_lib
from lib import internal
from lib import jax_util
from lib import meta as meta_lib
from lib import options
from lib import programs
from lib import report
from lib import results
from lib import schedules as schedules_lib
from lib import timing

FLAGS = flags.FLAGS
flags.DEFINE_string("host_floor_case", "512x4096x4096",
                    "host-floor: the global MxKxN of the tiny op.")
flags.DEFINE_integer("stats_calls", 200,
                     "host-floor: calls measured by the host counters.")


def _stats_per_call(fn, args, calls: int, devices: int) -> dict:
  """The handlers' host counters per device and call, or why there are none."""
  import jax
  try:
    library = internal.dma_library()
    platform = "cuda" if jax.devices()[0].platform == "gpu" else "cpu"
    jax.block_until_ready(fn(*args))
    library.reset_host_stats(platform)
    # XLA:CPU's collectives stall once many calls are queued (see
    # options.configure_timing): on CPU, block every few calls.
    every = 8 if platform == "cpu" else calls
    for i in range(calls):
      out = fn(*args)
      if (i + 1) % every == 0:
        jax.block_until_ready(out)
    jax.block_until_ready(out)
    return {name: {"per_call": n / (calls * devices),
                   "us_per_call": 1e6 * s / (calls * devices)}
            for name, (n, s) in library.host_stats(platform).items()}
  except Exception as e:  # pylint: disable=broad-except
    return {"unavailable": results.short_error(e, 300)}


def run() -> int:
  import jax
  w = FLAGS.axis_size or jax.device_count()
  meta = meta_lib.collect("host-floor")
  case = cases_lib.parse(FLAGS.host_floor_case)
  data = {"meta": meta, "timing": options.configure_timing(), "axis_size": w,
          "shape": [case.m, case.k, case.n], "ops": {}}
  rec = results.Recorder("host_floor", results.out_dir(meta["device_kind"], w),
                         data, markdown)
  mesh = jax_util.mesh_of(w)
  tk = options.timing_kwargs()
  labels = schedules_lib.parse(FLAGS.schedules)
  entries = []
  with timing.interleaved():
    for key in FLAGS.ops:
      op = programs.OPS[key]
      args = op.inputs(mesh, case, max(1, FLAGS.input_sets))
      in_specs, _ = op.specs
      trivial = jax_util.jit_shard_map(lambda a, b: a * 2, mesh, in_specs,
                                       in_specs[0])
      r = {"xla": results.guarded(rec, f"{key} xla", lambda op=op, args=args:
                                  timing.time_jax(op.shard_mapped(
                                      mesh, op.xla_body()), args, **tk)),
           "trivial": results.guarded(rec, f"{key} trivial",
                                      lambda t=trivial, args=args:
                                      timing.time_jax(t, args, **tk)),
           "ficco": {}}
      for label, sched in labels:
        fn = op.shard_mapped(mesh, op.ficco_body(sched))
        r["ficco"][label] = {"time": results.guarded(
            rec, f"{key} ficco {label}",
            lambda fn=fn, args=args: timing.time_jax(fn, args, **tk))}
        entries.append((r["ficco"][label], fn, args[0]))
      data["ops"][key] = r
    rec.progress("timing round-robin")
  for entry, fn, args in entries:
    entry["host"] = _stats_per_call(fn, args, FLAGS.stats_calls, w)
  rec.finish()
  return 0


def markdown(data: dict) -> str:
  m, k, n = data["shape"]
  lines = [f"# Host floor: {m}x{k}x{n} bf16, W={data['axis_size']}", ""]
  lines += report.provenance(data["meta"]) + [
      "", "ms per call, median over rounds (min), interleaved. Handler"
      " counters per device and call: start (count), its wait for the peers"
      " (rendezvous) and its copy issue, sync (count), stream waits per"
      " sync.", ""]
  rows = []
  for key, r in data["ops"].items():
    x = r["xla"].get("median_ms")

    def vs(t):
      return f"{x / t:.2f}x" if x and t else "-"
    rows.append([key, "xla", report.times(r["xla"]), "1.00x", "", "", "", "",
                 ""])
    rows.append([key, "trivial (a * 2)", report.times(r["trivial"]),
                 vs(r["trivial"].get("median_ms")), "", "", "", "", ""])
    for label, e in r["ficco"].items():
      h = e.get("host") or {}
      if "start" in h:
        waits = h["sync_waits"]["per_call"] / max(h["sync"]["per_call"], 1e-9)
        host = [f"{h['start']['us_per_call']:.1f} ({h['start']['per_call']:.0f})",
                f"{h['start_rendezvous']['us_per_call']:.1f}",
                f"{h['start_issue']['us_per_call']:.1f}",
                f"{h['sync']['us_per_call']:.1f} ({h['sync']['per_call']:.0f})",
                f"{waits:.1f}"]
      else:
        host = [h.get("unavailable", "-")[:60], "", "", "", ""]
      rows.append([key, f"`{label}`", report.times(e["time"]),
                   vs(e["time"].get("median_ms")), *host])
  lines += report.table(["op", "program", "ms", "vs XLA", "start us (n)",
                         "rendezvous us", "issue us", "sync us (n)",
                         "stream waits per sync"], rows)
  return "\n".join(lines + report.skipped(data)) + "\n"
