"""Suite ``autotune``: fills an autotune cache file (the package's data).

``--autotune_from=labels`` (default; no device time): per shape, the
fastest schedule of the measured labels (``--labels``, lib/labels.py;
default: the sweeps the shipped cache was filled from,
benchmarks/data/README.md), stored under the local shapes the op sees. A
schedule replaces XLA's program (``none``) only where it beats it by
``--margin`` in both the median and the fastest round (short copy-engine
ops are bimodal: one statistic alone picked schedules that lost when
measured again), against the faster of XLA's timings when a case timed
``none`` besides the baseline. ``--keep`` picks which run of a shape
decides: the one with the most schedules, the latest, or (``worst``) every
run, each schedule judged by its worst ratio over them.

``--autotune_from=measure``: runs ``ficco_jax.autotune`` on this host's
devices for every case of ``--ops`` (bf16).

``--cache_out`` is updated in place (entries of the same key replaced), so
successive runs refine one file; copy it to
``ficco_jax/data/autotune/<device_slug>.json`` to ship it, keeping its
``comment``.
"""

from __future__ import annotations

import json
import os

from absl import flags

from lib import cases as cases_lib
from lib import internal
from lib import labels as labels_lib
from lib import meta as meta_lib
from lib import options
from lib import report
from lib import results

FLAGS = flags.FLAGS
DATA = "benchmarks/data"
# The sweeps the shipped cache's bulk was filled from (--keep=latest);
# benchmarks/data/README.md lists the later refinements.
CACHE_LABELS = [
    f"{DATA}/labels_h200_w4_ag_ten_1.json",
    f"{DATA}/labels_h200_w4_rs_ten_2.json",
    f"{DATA}/labels_h200_w4_rs_all.json",
    f"{DATA}/labels_h200_w4_ag_all.json",
]
COMMENT = ("Autotuned schedules for {kind}, filled by `python"
           " benchmarks/bench.py --suite=autotune` from {src}. Keys are local"
           " shapes inside shard_map.")

flags.DEFINE_enum("autotune_from", "labels", ["labels", "measure"],
                  "autotune: from measured labels, or by running"
                  " ficco_jax.autotune here.")
flags.DEFINE_string("cache_out", None, "autotune: the cache file to update"
                    " (default: <out_dir>/autotune_cache.json).")
flags.DEFINE_enum("keep", "latest", ["fullest", "latest", "worst"],
                  "autotune: per shape, the run with the most schedules, the"
                  " last one with at least --min_schedules, or every such"
                  " run judged by its worst ratio to XLA.")
flags.DEFINE_integer("min_schedules", 4, "autotune: for --keep=latest/worst.")
flags.DEFINE_float("margin", 0.03, "autotune: keep XLA's program unless a"
                   " schedule beats it by this fraction.")
flags.DEFINE_list("autotune_cases", [], "autotune: only these case names"
                  " (e.g. llama3-8b/M8192) of the labels; default: all.")


def _ratios(c, fastest, fastest_xla) -> dict:
  """Per schedule of case ``c``: its time over XLA's program's, the larger
  of the median and the fastest-round ratios (module docstring)."""
  times, mins = dict(c.times), fastest[id(c)]
  none = next((s for s in times if s.dataflow == "none"), None)
  ref = min(x for x in (times[none], c.xla_ms) if x is not None)
  ref_min = min(x for x in (mins.get(none, times[none]), fastest_xla[id(c)])
                if x is not None)
  return {s: max(t / ref, mins.get(s, t) / ref_min)
          for s, t in times.items() if s != none}


def _worst_case_pick(runs, fastest, fastest_xla):
  """The schedule whose worst ratio over ``runs`` (of one shape) is lowest,
  if it beats XLA by the margin in every run; else ``none``. Only schedules
  every run measured compete; a run without XLA's "none" does not vote."""
  runs = [c for c in runs if any(s.dataflow == "none" for s in dict(c.times))]
  ratios = [_ratios(c, fastest, fastest_xla) for c in runs]
  common = set(ratios[0]).intersection(*ratios[1:])
  worst = {s: max(r[s] for r in ratios) for s in common}
  none = next(s for s in dict(runs[-1].times) if s.dataflow == "none")
  wins = [s for s, r in worst.items() if r <= 1 - FLAGS.margin]
  return min(wins, key=worst.get) if wins else none


def from_labels(paths, kind, cache) -> tuple[str, list[dict]]:
  cases, meta_kind = labels_lib.load(paths, stat="median_ms")
  kind = kind or meta_kind
  # The fastest round of each schedule, per file and case (both loads read
  # the same files in the same order, so cases pair up one to one).
  fastest_cases = labels_lib.load(paths, stat="min_ms")[0]
  if [(c.run, c.op, c.name, c.p) for c in fastest_cases] != [
      (c.run, c.op, c.name, c.p) for c in cases]:
    raise ValueError("median and fastest-round loads disagree on the cases")
  fastest = {id(c): dict(f.times) for c, f in zip(cases, fastest_cases)}
  fastest_xla = {id(c): f.xla_ms for c, f in zip(cases, fastest_cases)}
  chosen, runs = {}, {}
  for c in cases:
    if FLAGS.autotune_cases and c.name not in FLAGS.autotune_cases:
      continue
    key = (c.op, c.p, c.local())
    if FLAGS.keep in ("latest", "worst"):
      if len(c.times) >= FLAGS.min_schedules:
        chosen[key] = c
        runs.setdefault(key, []).append(c)
    elif key not in chosen or len(c.times) >= len(chosen[key].times):
      # A run that timed only the default must not replace a fuller one.
      chosen[key] = c
  picks = []
  for key, c in chosen.items():
    times = dict(c.times)  # Medians over rounds.
    none = next((s for s in times if s.dataflow == "none"), None)
    if FLAGS.keep == "worst" and none is not None:
      best = _worst_case_pick(runs[key], fastest, fastest_xla)
    elif none is None:
      best = min(times, key=times.get)
    else:
      wins = [s for s, r in _ratios(c, fastest, fastest_xla).items()
              if r <= 1 - FLAGS.margin]
      best = min(wins, key=times.get) if wins else none
    x, w = c.local()
    cache.store(cache.Key.of(c.op, device_kind=kind, axis_size=c.p,
                             x_shape=x, w_shape=w, axis=0, dtype="bfloat16"),
                best, timings_ms={s.short(): t for s, t in times.items()})
    picks.append({"op": c.op, "case": c.name, "P": c.p, "run": c.run,
                  "x": list(x), "w": list(w), "schedule": best.short(),
                  "ms": times[best], "none_ms": times.get(none)})
  return kind, picks


def measure(kind_hint) -> tuple[str, list[dict]]:
  import jax
  import jax.numpy as jnp
  import ficco_jax
  from lib import jax_util
  w = FLAGS.axis_size or jax.device_count()
  mesh = jax_util.mesh_of(w)
  picks = []
  for key in FLAGS.ops:
    for c in options.case_list(key):
      x = jax.random.normal(jax.random.key(0), (c.m, c.k), jnp.bfloat16)
      wt = jax.random.normal(jax.random.key(1), (c.k, c.n), jnp.bfloat16)
      try:
        res = ficco_jax.autotune(cases_lib.OPS[key], x, wt, mesh=mesh,
                                 axis_name="x")
        picks.append({"op": cases_lib.OPS[key], "case": c.name, "P": w,
                      "schedule": res.best.short(),
                      "errors": len(res.errors)})
      except Exception as e:  # pylint: disable=broad-except
        picks.append({"op": cases_lib.OPS[key], "case": c.name, "P": w,
                      "error": results.short_error(e)})
      print(picks[-1], flush=True)
  return kind_hint or jax.devices()[0].device_kind, picks


def run() -> int:
  import ficco_jax
  cache = internal.tuning("autotune_cache")
  from_measure = FLAGS.autotune_from == "measure"
  meta = meta_lib.collect("autotune", devices=from_measure)
  labels = FLAGS.labels or CACHE_LABELS
  directory = FLAGS.out_dir or (results.out_dir(
      meta["device_kind"], FLAGS.axis_size or meta["device_count"])
      if from_measure else os.path.join(results.RESULTS_DIR, "autotune"))
  path = FLAGS.cache_out or os.path.join(directory, "autotune_cache.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  ficco_jax.set_autotune_cache(path)
  if from_measure:
    kind, picks = measure(FLAGS.label_device_kind)
    src = "ficco_jax.autotune runs"
  else:
    kind, picks = from_labels(labels, FLAGS.label_device_kind, cache)
    src = ", ".join(labels) + (f" (--keep={FLAGS.keep} --margin={FLAGS.margin:g}"
                               f" --min_schedules={FLAGS.min_schedules})")
  with open(path) as f:
    cache_data = json.load(f)
  cache_data["comment"] = COMMENT.format(kind=kind, src=src)
  results.write_json(path, cache_data)
  print(f"wrote {path} ({len(cache_data['entries'])} entries)", flush=True)
  data = {"meta": dict(meta, device_kind=kind), "cache": path,
          "from": FLAGS.autotune_from, "labels": labels if not from_measure
          else None, "picks": picks}
  results.Recorder("autotune", directory, data, markdown).finish()
  return 0


def markdown(data: dict) -> str:
  lines = ["# Autotune cache fill", ""] + report.provenance(data["meta"])
  lines += ["", f"Cache: `{data['cache']}`, from {data['from']}"
            + (f": {', '.join(data['labels'])}" if data.get("labels") else ""),
            ""]
  lines += report.table(
      ["op", "case", "P", "schedule", "ms", "none ms", "run"],
      [[p["op"], p["case"], p["P"], f"`{p.get('schedule', p.get('error'))}`",
        report.num(p.get("ms")), report.num(p.get("none_ms")), p.get("run", "")]
       for p in data["picks"]])
  return "\n".join(lines) + "\n"
