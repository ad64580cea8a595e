"""Suite ``ops``: both collective matmuls against XLA, on the benchmark cases.

Per op and case (see lib/programs.py for the layouts) it times

  matmul       the local product alone            } outside the round-robin;
  comm         XLA's collective alone (NCCL)      } they set the ideal
  xla          XLA's collective + dot in shard_map
  xla_overlap  XLA's product pjit style with the latency-hiding scheduler
               and windowed einsums (GPU; ``--xla_overlap``)
  ficco        ficco_jax.<op> with each ``--schedules`` label
  mosaic       JAX's Mosaic GPU collective matmul (all-gather, ``--peers``)

interleaved round-robin (lib/timing.py), checks every program once against
an f32 reference, and reports each method's speedup over ``xla_best``, the
faster correct XLA program. Only ficco_jax's public API is used, so the same
command measures an older release for a before/after comparison (suite
``compare``).
"""

from __future__ import annotations

import gc
import os

from absl import flags

from lib import cases as cases_lib
from lib import gpu_monitor
from lib import jax_util
from lib import meta as meta_lib
from lib import mosaic
from lib import multiprocess
from lib import options
from lib import programs
from lib import results
from lib import schedules as schedules_lib
from lib import timing
from suites import ops_report

FLAGS = flags.FLAGS
flags.DEFINE_list("ops", ["ag", "rs"], "Ops: ag (all_gather_matmul), rs"
                  " (matmul_reduce_scatter).")
flags.DEFINE_list("schedules", ["default"],
                  "ficco schedules: 'default' (schedule=None), 'none',"
                  " labels as Schedule.short() prints them"
                  " (dataflow/cN[/comm[/compute]]) or presets quick, all, tuning.")
flags.DEFINE_list("peers", [], "Other implementations: mosaic (all-gather,"
                  " Hopper, whole mesh). PyTorch runs in suite 'peers'.")
flags.DEFINE_list("mosaic_configs", ["128x128x64x4", "128x256x64x4"],
                  "Mosaic tile search: tile_m x tile_n x tile_k x stages.")
flags.DEFINE_enum("xla_overlap", "auto", ["auto", "on", "off"],
                  "Time XLA with its overlap flags too (auto: on GPUs; on:"
                  " anywhere, e.g. to smoke-test the path on CPU).")
flags.DEFINE_float("tol", 2e-2, "Relative error a bf16 result may have"
                   " (or twice XLA's own, if larger).")
flags.DEFINE_bool("check", True, "Check every program against f32 once.")
flags.DEFINE_integer("retime_top", 0, "After a case's round-robin, time"
                     " schedule=None, the N fastest other ficco schedules and"
                     " XLA's program again in a second round-robin; the"
                     " accuracy report scores schedule=None on it (the"
                     " fastest of many noisy timings is biased low: a second"
                     " pass of the few that matter is not).")


def run() -> int:
  if FLAGS.processes > 1 and not multiprocess.is_child():
    return multiprocess.relaunch(FLAGS.processes)
  import jax

  timing.set_agree(multiprocess.agree)
  w = FLAGS.axis_size or jax.device_count()
  meta = meta_lib.collect("ops")
  directory = results.out_dir(meta["device_kind"], w, jax.process_count())
  peers_path = os.path.join(directory, "peers.json")
  data = {"meta": meta, "timing": options.configure_timing(),
          "axis_size": w, "tol": FLAGS.tol, "check": FLAGS.check,
          "xla_overlap_options": programs.OVERLAP_OPTIONS,
          "schedules": FLAGS.schedules, "ops": {}, "summary": {}}
  rec = results.Recorder(
      "ops", directory, data,
      lambda d: ops_report.markdown(d, ops_report.load_peers(peers_path)),
      writer=multiprocess.is_writer(), agree=multiprocess.agree)
  mesh = jax_util.mesh_of(w)
  labels = schedules_lib.parse(FLAGS.schedules)
  for key in FLAGS.ops:
    op = programs.OPS[key]
    op_cases = data["ops"].setdefault(key, {"name": op.name, "cases": []})
    for case in options.case_list(key):
      what = f"{key} {case.name} W={w}"
      why = cases_lib.divisible(key, case, w)
      if why or rec.over_budget():
        rec.skip(what, why or "time budget")
        continue
      c = measure_case(rec, op, case, mesh, labels)
      ops_report.summarize_case(c)
      op_cases["cases"].append(c)
      if rec.writer:
        print(ops_report.case_line(key, c), flush=True)
      rec.save()
      gc.collect()
      jax.clear_caches()
  data["summary"] = ops_report.summary(data)
  if rec.writer:
    data["png"] = ops_report.plot(data, ops_report.load_peers(peers_path),
                                  rec.png_path)
  rec.finish()
  return 0


def measure_case(rec: results.Recorder, op: programs.Op, case, mesh,
                 labels) -> dict:
  """Every program of one case; the dicts interleaved timing fills in."""
  w = mesh.shape["x"]
  a_local, w_local = cases_lib.local_shapes(op.key, case, w)
  c = {"name": case.name, "W": w, "M": case.m, "K": case.k, "N": case.n,
       "local": {"a": list(a_local), "w": list(w_local)},
       "flops_per_device": 2 * case.m * case.k * case.n // w,
       "baselines": {}, "xla": {}, "methods": []}
  tag = f"{op.key} {case.name} W={w}"
  args = op.inputs(mesh, case, max(1, FLAGS.input_sets))
  tk = options.timing_kwargs()

  # The light programs only set the ideal: timed now, not round-robin.
  for name, build in (("matmul", op.matmul_alone), ("comm", op.comm_alone)):
    def light(build=build):
      fn, sets = build(mesh, case, args)
      return timing.time_jax(fn, sets, **tk, interleave=False)
    c["baselines"][name] = results.guarded(rec, f"{tag} {name} alone", light)

  ref32 = None
  if FLAGS.check:
    try:
      ref32 = op.shard_mapped(mesh, op.reference_body())(*args[0])
    except Exception as e:  # pylint: disable=broad-except
      c["check_error"] = results.short_error(e)
  c["resolved"], c["resolved_reason"] = resolve_default(op, a_local, w_local,
                                                       w)

  # The GPUs' clocks and power during the round-robin (not the compiles).
  mon = gpu_monitor.Monitor()
  with timing.interleaved(around=mon):
    xla = results.guarded(rec, f"{tag} xla", lambda: jax_util.measure(
        lambda cv: op.shard_mapped(mesh, op.xla_body(), cv), args=args,
        ref32=ref32, xla_err=None, tol=FLAGS.tol, tk=tk))
    c["xla"]["shard_map"] = xla
    xla_err = xla.get("rel_err")
    c["xla"]["overlap"] = xla_overlap(rec, op, mesh, args, ref32, xla_err,
                                      tag)

    def measure(build):
      return jax_util.measure(build, args=args, ref32=ref32, xla_err=xla_err,
                              tol=FLAGS.tol, tk=tk)

    for label, sched in labels:
      if rec.over_budget():
        rec.skip(f"{tag} ficco {label}", "time budget")
        continue
      if (why := schedules_lib.applies(op.key, sched)) is not None:
        rec.skip(f"{tag} ficco {label}", why)
        continue
      m = results.guarded(rec, f"{tag} ficco {label}", lambda s=sched: measure(
          lambda cv: op.shard_mapped(mesh, op.ficco_body(s), cv)))
      m.update(method="ficco", label=label)
      if sched is None:
        m["resolved"] = c["resolved"]
      c["methods"].append(m)
    if op.key == "ag" and "mosaic" in FLAGS.peers:
      run_mosaic(rec, c, mesh, measure, tag)
    if c["methods"] or c["xla"]:
      rec.progress(f"{tag}: timing round-robin")
  c["gpus_while_timed"] = mon.summary
  if FLAGS.retime_top > 0 and not rec.over_budget():
    retime(rec, op, mesh, args, c, dict(labels), tk, tag)
  return c


def retime(rec, op, mesh, args, c, schedules, tk, tag) -> None:
  """The second pass of ``--retime_top``: schedule=None, the fastest other
  ficco schedules of the first pass and XLA's correct programs (in
  shard_map, and with its overlap flags: XLA at its best is the faster of
  the two in this pass too), timed round-robin again; each record gets its
  ``retime`` timings."""
  ok = sorted((m for m in c["methods"] if m.get("method") == "ficco"
               and ops_report.timed_ok(m) and m["label"] in schedules),
              key=lambda m: m["median_ms"])
  picked = [m for m in ok if m["label"] == "default"]
  picked += [m for m in ok if m["label"] != "default"][:FLAGS.retime_top]
  if not picked:
    return
  xla = c["xla"].get("shard_map")
  rec.progress(f"{tag}: timing {len(picked)} schedules again")

  def again(build):
    # Checked against the reference in the first pass: timed only.
    return jax_util.measure(build, args=args, ref32=None, xla_err=None,
                            tol=FLAGS.tol, tk=tk)

  with timing.interleaved():
    for m in picked:
      sched = schedules[m["label"]]
      m["retime"] = results.guarded(
          rec, f"{tag} ficco {m['label']} (again)",
          lambda s=sched: again(lambda cv: op.shard_mapped(
              mesh, op.ficco_body(s), cv)))
    if ops_report.timed_ok(xla):
      xla["retime"] = results.guarded(
          rec, f"{tag} xla (again)", lambda: again(
              lambda cv: op.shard_mapped(mesh, op.xla_body(), cv)))
    overlap = c["xla"].get("overlap")
    if ops_report.timed_ok(overlap):
      def overlap_again(without=tuple(overlap.get("left_out", ()))):
        # The same options the first pass kept (checked there).
        fn, _ = op.xla_overlap(mesh, args, without)
        return timing.time_jax(fn, args, **tk)
      overlap["retime"] = results.guarded(rec, f"{tag} xla_overlap (again)",
                                          overlap_again)


def xla_overlap(rec, op, mesh, args, ref32, xla_err, tag) -> dict:
  """XLA at its best: the pjit-style program with its overlap flags."""
  import jax
  if FLAGS.xla_overlap == "off":
    return {"skipped": "--xla_overlap=off"}
  platform = jax.devices()[0].platform
  if FLAGS.xla_overlap == "auto" and platform != "gpu":
    return {"skipped": f"the overlap flags are GPU options (platform is"
                       f" {platform}); --xla_overlap=on times it anyway"}

  def build():
    import time

    def compiled(without=()):
      t0 = time.perf_counter()
      fn, notes = op.xla_overlap(mesh, args, without)
      notes["compile_s"] = time.perf_counter() - t0
      if ref32 is not None:
        jax_util.check(notes, fn(*args[0]), ref32, tol=FLAGS.tol,
                       xla_err=xla_err)
      return fn, notes

    fn, notes = compiled()
    if notes.get("ok") is False:
      # A wrong program is no baseline: XLA at its best is the fastest right
      # one, so build it again without the option that broke it.
      wrong = {k: notes[k] for k in ("compiler_options", "rel_err")}
      fn, notes = compiled(programs.OVERLAP_FALLBACK_WITHOUT)
      notes["wrong_with_every_option"] = wrong
      notes["left_out"] = list(programs.OVERLAP_FALLBACK_WITHOUT)
    res = timing.time_jax(fn, args, **options.timing_kwargs())
    res.update(notes)  # In place: interleaved timing fills `res` later.
    return res
  return results.guarded(rec, f"{tag} xla_overlap", build)


def run_mosaic(rec, c, mesh, measure, tag) -> None:
  reason = mosaic.unsupported(mesh.shape["x"])
  if reason:
    c["methods"].append({"method": "mosaic", "label": "*", "skipped": reason})
    return
  for cfg in FLAGS.mosaic_configs:
    if rec.over_budget():
      rec.skip(f"{tag} mosaic {cfg}", "time budget")
      continue
    # The kernel needs check_vma=False.
    m = results.guarded(rec, f"{tag} mosaic {cfg}", lambda cfg=cfg: measure(
        lambda cv: jax_util.jit_shard_map(
            mosaic.kernel(cfg), mesh, *programs.OPS["ag"].specs,
            check_vma=False)))
    m.update(method="mosaic", label=cfg)
    c["methods"].append(m)


def resolve_default(op, a_local, w_local, w) -> tuple[str, str]:
  """What ``schedule=None`` runs here and why, from ``ficco_jax.explain``."""
  try:
    import ficco_jax
    import jax.numpy as jnp
    e = ficco_jax.explain(op.name, x_shape=a_local, w_shape=w_local,
                          dtype=jnp.bfloat16, axis_size=w)
    return f"{e.chosen.short()} ({e.source})", e.reason
  except Exception as e:  # pylint: disable=broad-except
    return f"unknown ({results.short_error(e, 300)})", ""
