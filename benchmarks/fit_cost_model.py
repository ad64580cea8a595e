"""Fits the cost model's device parameters from a characterize.py result.

Writes ``ficco_jax/data/cost_model/<device_kind_slug>.json`` (or --out), which
`ficco_jax._src.device_params.params_for` overlays on the built-in values:

  matmul_eff, decomposition  from single dots and chunked dots: achieved
                 FLOP/s per piece height, relative to the tallest pieces;
  contention     per engine, (alpha, beta) such that the overlap model
                 reproduces "both" from "mm_alone" and "copy_alone";
  receive_bw     per number of peers, the slope of time vs bytes received
                 (copy section, engine dma); dma_op_s from the intercept;
  p2p_bw, p2p_latency_s  the same for engine xla with one peer.

  python3 benchmarks/fit_cost_model.py \
      --characterization=benchmarks/results/characterize_gpu_4dev.json
"""

from __future__ import annotations

import collections
import json
import math
import os
import statistics
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # After the installed package.

from ficco_jax._src import device_params  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("characterization", None, "characterize.py JSON.")
flags.DEFINE_string("out", None, "Output (default: the package data file).")
flags.DEFINE_float("peak_flops", None,
                   "Peak the efficiencies are relative to (default: the"
                   " device kind's built-in matmul_flops).")


def _ok(records):
  return [r for r in records if r.get("median_ms")]


def fit_decomposition(records, peak: float, launch_s: float):
  """(matmul_eff, ((rows, relative efficiency), ...)) from dot timings."""
  by_rows = collections.defaultdict(list)
  for r in _ok(records):
    pieces = r["chunks"] if r["kind"] == "split" else 1
    per_piece = r["median_ms"] * 1e-3 / pieces - launch_s
    if per_piece <= 0:
      continue
    flops = 2.0 * r["piece_rows"] * r["K"] * r["n"]
    by_rows[r["piece_rows"]].append(flops / per_piece / peak)
  if not by_rows:
    return None, ()
  # Bucket to powers of two (piece heights of different shapes differ a bit).
  buckets = collections.defaultdict(list)
  for rows, effs in by_rows.items():
    buckets[2 ** round(math.log2(rows))].extend(effs)
  table = sorted((rows, statistics.median(e)) for rows, e in buckets.items())
  top = max(e for _, e in table)
  rel, best = [], 0.0
  for rows, e in table:
    best = max(best, e / top)  # Monotone: taller is never worse.
    rel.append((int(rows), round(best, 4)))
  return min(top, 1.0), tuple(rel)


def overlap_time(t_mm: float, t_copy: float, alpha: float, beta: float):
  """Both started together; each slowed while the other runs."""
  a, b = t_mm * (1 + alpha), t_copy * (1 + beta)
  if a <= b:
    return a + (1 - a / b) * t_copy
  return b + (1 - b / a) * t_mm


def fit_contention(records):
  """{engine: (alpha, beta)} minimising the squared log error of "both"."""
  mm = {tuple(r["mm"]): r["median_ms"] for r in _ok(records)
        if r["what"] == "mm_alone"}
  copy = {(r["engine"], r["mib_per_peer"]): r["median_ms"]
          for r in _ok(records) if r["what"] == "copy_alone"}
  samples = collections.defaultdict(list)
  for r in _ok(records):
    if r["what"] != "both":
      continue
    t_mm, t_c = mm.get(tuple(r["mm"])), copy.get((r["engine"],
                                                  r["mib_per_peer"]))
    if t_mm and t_c:
      samples[r["engine"]].append((t_mm, t_c, r["median_ms"]))
  grid = [i / 100 for i in range(0, 301, 2)]
  out = {}
  for engine, ss in samples.items():
    def err(ab):
      return sum(math.log(overlap_time(m, c, *ab) / t) ** 2 for m, c, t in ss)
    out[engine] = min(((a, b) for a in grid for b in grid), key=err)
  return out


def _linear(points):
  """Least squares t = c0 + c1 * x."""
  n = len(points)
  mx = sum(x for x, _ in points) / n
  my = sum(y for _, y in points) / n
  sxx = sum((x - mx) ** 2 for x, _ in points)
  if sxx == 0:
    return my, None
  c1 = sum((x - mx) * (y - my) for x, y in points) / sxx
  return my - c1 * mx, c1


def fit_copies(records):
  """(receive_bw per peers, dma intercept, xla (bw, latency) per transfer)."""
  fits = {}
  for engine in ("dma", "xla"):
    for peers in (1, 2, 3):
      pts = [(r["bytes_per_peer"] * peers, r["median_ms"] * 1e-3)
             for r in _ok(records)
             if r["engine"] == engine and r["peers"] == peers]
      if len(pts) >= 2:
        c0, c1 = _linear(pts)
        if c1 and c1 > 0:
          fits[(engine, peers)] = (1.0 / c1, max(c0, 0.0))
  return fits


def fit(char: dict) -> dict:
  kind = char["meta"]["device_kind"]
  base = device_params.params_for(kind)
  peak = FLAGS.peak_flops or base.matmul_flops
  params, measured = {}, []
  eff, table = fit_decomposition(char.get("decomposition", []), peak,
                                 base.launch_s)
  if eff:
    params.update(matmul_eff=eff, decomposition=[list(t) for t in table])
    measured += ["matmul_eff", "decomposition"]
  cont = fit_contention(char.get("contention", []))
  if cont:
    merged = {c: (a, b) for c, a, b in base.contention}
    merged.update(cont)
    params["contention"] = [[c, a, b] for c, (a, b) in sorted(merged.items())]
    measured += [f"contention[{c}]" for c in sorted(cont)]
  copies = fit_copies(char.get("copy", []))
  dma = [copies.get(("dma", k)) for k in (1, 2, 3)]
  if any(dma):
    known = [f for f in dma if f]
    # Peers not measured keep the nearest measured bandwidth.
    bws, last = [], known[0][0]
    for f in dma:
      last = f[0] if f else last
      bws.append(last)
    params["receive_bw"] = bws
    params["dma_op_s"] = statistics.median(f[1] for f in known)
    measured += ["receive_bw", "dma_op_s"]
  if ("xla", 1) in copies:
    params["p2p_bw"], params["p2p_latency_s"] = copies[("xla", 1)]
    measured += ["p2p_bw", "p2p_latency_s"]
  params["measured"] = sorted(set(base.measured) | set(measured))
  device_params.params_for(kind, overrides=params)  # Validates.
  return {"device_kind": kind,
          "source": {"command": char["meta"].get("command"),
                     "date": char["meta"].get("date"),
                     "jax": char["meta"].get("jax")},
          "params": params}


def main(argv):
  del argv
  with open(FLAGS.characterization) as f:
    char = json.load(f)
  result = fit(char)
  # Default: the source tree's package data (to commit), not the package
  # that happens to be imported (an install in site-packages).
  out = FLAGS.out or os.path.join(
      os.path.dirname(HERE), "ficco_jax", "data", "cost_model",
      f"{device_params.slug(result['device_kind'])}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flag_as_required("characterization")
  app.run(main)
