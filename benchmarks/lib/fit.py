"""Fitting the cost model's device parameters to measurements.

Two stages (the shipped H200 values are the result of both):

1. Components, from a characterize result (`fit`):

  receive_bw     per number of peers, the slope of time vs bytes received
                 (copy section, engine dma);
  p2p_bw, p2p_latency_s  the same for engine xla with one peer;
  contention     per engine, (alpha, beta) such that the overlap model
                 reproduces "both" from "mm_alone" and "copy_alone";
  matmul_eff, decomposition  from single dots and chunked dots: achieved
                 FLOP/s by the dot's output tiles, relative to the largest
                 (`COMPONENTS` says which fields the shipped values take).

   The copy section's intercept is not the copy engines' per-op cost: XLA's
   own all-gather of 1 MiB/peer takes as long, so it is mostly the cost of
   dispatching a multi-device program, which the per-op terms carry.

2. Per-op terms, from ops results of the fit split (`fit_benchmarks`):
   host_call_s, host_op_s, dma_op_s, ce_latency_s and contention[dma], by
   coordinate descent on the squared log error of predicted vs measured
   time over every measured compute='xla' schedule, each case's mean log
   error removed first: the heuristic ranks schedules within a case, and a
   dot the roofline mis-times shifts all of them.

Plus, on top (what the package data file ships): `fit_decomposition_scale`
and the per-family `fit_calibration`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

from lib import internal


def _params():
  return internal.tuning("device_params")


def _cost_model():
  return internal.tuning("cost_model")


def _ok(records):
  return [r for r in records if r.get("median_ms")]


def fit_decomposition(records, peak: float, launch_s: float,
                      min_piece_s: float = 50e-6):
  """(matmul_eff, ((output tiles, relative efficiency), ...)) from dots.

  A dot's output tiles (``rows * n / cost_model.TILE**2``) say how well it
  fills the SMs, which sets its efficiency more than its height alone.
  Pieces shorter than ``min_piece_s`` are left out: their time is mostly the
  dispatch of the measured call. Relative efficiencies are made monotone
  from the largest dots down (a running minimum), so a noisy small dot
  cannot lift the whole curve.
  """
  cost_model = _cost_model()
  buckets = collections.defaultdict(list)
  for r in _ok(records):
    pieces = r["chunks"] if r["kind"] == "split" else 1
    per_piece = r["median_ms"] * 1e-3 / pieces - launch_s
    if per_piece < min_piece_s:
      continue
    flops = 2.0 * r["piece_rows"] * r["K"] * r["n"]
    tiles = r["piece_rows"] * r["n"] / cost_model.TILE**2
    # Bucket to powers of two (dots of different shapes differ a bit).
    buckets[2 ** round(math.log2(tiles))].append(flops / per_piece / peak)
  if not buckets:
    return None, ()
  table = sorted((t, statistics.median(e)) for t, e in buckets.items())
  top = max(e for _, e in table)
  rel, low = [], 1.0
  for tiles, e in reversed(table):
    low = min(low, e / top)
    rel.append((int(tiles), round(low, 4)))
  return min(top, 1.0), tuple(reversed(rel))


def overlap_time(t_mm: float, t_copy: float, alpha: float, beta: float):
  """Both started together; each slowed while the other runs."""
  a, b = t_mm * (1 + alpha), t_copy * (1 + beta)
  if a <= b:
    return a + (1 - a / b) * t_copy
  return b + (1 - b / a) * t_mm


def _both_with_alone(records):
  """``(record, compute, t_mm, t_copy)`` for each "both" record whose
  matmul (of its compute label) and copies were also timed alone."""
  ok = _ok(records)
  mm = {(tuple(r["mm"]), r.get("compute", "xla")): r["median_ms"]
        for r in ok if r["what"] == "mm_alone"}
  copy = {(r["engine"], r["mib_per_peer"]): r["median_ms"]
          for r in ok if r["what"] == "copy_alone"}
  for r in ok:
    if r["what"] != "both":
      continue
    compute = r.get("compute", "xla")
    t_mm = mm.get((tuple(r["mm"]), compute))
    t_copy = copy.get((r["engine"], r["mib_per_peer"]))
    if t_mm and t_copy:
      yield r, compute, t_mm, t_copy


def fit_contention(records):
  """{engine: (alpha, beta)} minimising the squared log error of "both".

  Only the records of XLA's dot: the cost model's matmul is XLA's, and the
  Pallas kernel's records (``compute``: the occupancy knob's measurements)
  are read by ``contention_summary``.
  """
  samples = collections.defaultdict(list)
  for r, compute, t_mm, t_c in _both_with_alone(records):
    if compute == "xla":
      samples[r["engine"]].append((t_mm, t_c, r["median_ms"]))
  grid = [i / 100 for i in range(0, 301, 2)]
  out = {}
  for engine, ss in samples.items():
    def err(ab):
      return sum(math.log(overlap_time(m, c, *ab) / t) ** 2 for m, c, t in ss)
    out[engine] = min(((a, b) for a in grid for b in grid), key=err)
  return out


def contention_summary(records):
  """Per matmul, compute label, engine and copy size: the matmul alone, the
  copies alone, both, and ``hidden``: the share of the shorter of the two
  that overlapping hid (1: both took as long as the longer one alone; 0:
  as long as the two one after the other).

  The same copies (``copy_alone``, measured once per engine and size) are
  the baseline of every compute label, so the labels compare as the
  matmul's cost alone against what it leaves the copies.
  """
  rows = []
  for r, compute, t_mm, t_copy in _both_with_alone(records):
    t_both = r["median_ms"]
    rows.append({
        "mm": list(r["mm"]), "compute": compute, "engine": r["engine"],
        "mib_per_peer": r["mib_per_peer"], "mm_ms": t_mm, "copy_ms": t_copy,
        "both_ms": t_both,
        "hidden": (t_mm + t_copy - t_both) / min(t_mm, t_copy)})
  return rows


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


# Stage-1 fields the shipped parameters take from the characterisation.
# decomposition: the efficiency of one dot by its output tiles, relative to
# the largest (single dots of each piece size; pieces under 50 us left out).
# Not matmul_eff: the built-in roofline level already matches the measured
# dots of measurements.md (tests/test_cost_model.py), and the
# characterisation's tallest dots set it only within a few percent.
COMPONENTS = ("receive_bw", "p2p_bw", "p2p_latency_s", "contention",
              "decomposition")


def fit(char: dict, base=None, peak_flops: float | None = None) -> dict:
  """Stage 1: component fields from a characterize result.

  Args:
    char: the characterize suite's JSON.
    base: the DeviceParams to start from (default: the device kind's).
    peak_flops: what efficiencies are relative to (default: base's).

  Returns:
    ``{"device_kind", "source", "params"}`` (the device-params file).
  """
  device_params = _params()
  kind = char["meta"]["device_kind"]
  base = base or device_params.params_for(kind)
  peak = peak_flops or base.matmul_flops
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
    measured += ["receive_bw"]
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


# ---------------------------------------------------------------- stage 2

# Per-op terms fitted end to end: (start, lower bound, upper bound). The
# search starts here, not at the shipped values, so that refitting gives the
# same numbers whatever device_params.py holds.
PER_OP = {
    "host_call_s": (100e-6, 0.0, 1e-3),
    "host_op_s": (30e-6, 0.0, 300e-6),
    "dma_op_s": (20e-6, 0.0, 300e-6),
    "ce_latency_s": (8e-6, 0.0, 200e-6),
    "alpha[dma]": (0.05, 0.0, 1.0),
    "beta[dma]": (0.05, 0.0, 1.0),
    "decomposition_scale": (1.0, 0.0, 1.5),
    # Copy-engine receive bandwidth with 1 / 3 peers sending at once, as a
    # factor on the characterisation's (2 peers: interpolated).
    "receive_bw[1]": (1.0, 0.5, 1.2),
    "receive_bw[3]": (1.0, 0.5, 1.2),
}


def _with(params, values: dict):
  fields = {k: v for k, v in values.items() if "[" not in k}
  cont = {c: [a, b] for c, a, b in params.contention}
  if "receive_bw[1]" in values or "receive_bw[3]" in values:
    bw = list(params.receive_bw)
    f1, f3 = values.get("receive_bw[1]", 1.0), values.get("receive_bw[3]", 1.0)
    bw = [bw[0] * f1, bw[1] * (f1 + f3) / 2] + [b * f3 for b in bw[2:]]
    fields["receive_bw"] = tuple(bw)
  for k, v in values.items():
    if k.startswith("receive_bw["):
      continue
    if "[" in k:
      name, comm = k[:-1].split("[")
      cont.setdefault(comm, [0.0, 0.0])[0 if name == "alpha" else 1] = v
  fields["contention"] = tuple((c, a, b) for c, (a, b) in sorted(cont.items()))
  return dataclasses.replace(params, **fields)


def fit_error(cases, params) -> float:
  """Squared log error, each case's mean removed, over compute='xla' times."""
  cost_model = _cost_model()
  err = 0.0
  for c in cases:
    prob = c.problem()
    r = [math.log(cost_model.predict(prob, s, params).total * 1e3 / ms)
         for s, ms in c.times if s.compute == "xla"]
    if len(r) >= 2:
      mu = sum(r) / len(r)
      err += sum((x - mu) ** 2 for x in r)
  return err


def fit_benchmarks(cases, kind: str, char: dict, sweeps: int = 6) -> dict:
  """Stage 1 (``char``) then stage 2 on ``cases``.

  Args:
    cases: labelled cases of the fit split (`lib.labels.Case`).
    kind: the device kind.
    char: a characterize result.
    sweeps: coordinate-descent sweeps over the per-op terms.

  Returns:
    ``{"params": {field: value}, "error": ..., "objective": ...}``: every
    field stage 1 (`COMPONENTS`) and stage 2 (`PER_OP`) set, ready for
    ``device_params.params_for(kind, overrides=...)``.
  """
  device_params = _params()
  base = device_params.params_for(kind)
  comp = fit(char, base)["params"]
  # The per-op terms are fitted to the component model: without the shipped
  # family calibration, which was fitted on top of them.
  params = dataclasses.replace(device_params.params_for(
      kind, overrides={k: comp[k] for k in COMPONENTS if k in comp}),
                               calibration=())
  bounds = dict(PER_OP)
  # An op cannot take less than its host floor: host_call_s is at most the
  # fastest time measured for any op of the fit split. (The objective sees
  # only ratios within a case, so without this bound a floor above every
  # measured time would cost it nothing.)
  floor = min(ms for c in cases for _, ms in c.times) * 1e-3
  start, lo, hi = bounds["host_call_s"]
  bounds["host_call_s"] = (min(start, floor), lo, min(hi, floor))
  values = {k: v[0] for k, v in bounds.items()}
  best = fit_error(cases, _with(params, values))
  for sweep in range(sweeps):
    for name, (_, lo, hi) in bounds.items():
      # A grid over the whole range first, then finer around the best.
      span = (hi - lo) / (2 ** sweep)
      for _ in range(3):
        grid = [min(hi, max(lo, values[name] + span * (i / 10 - 1)))
                for i in range(21)]
        for v in grid:
          trial = dict(values, **{name: v})
          e = fit_error(cases, _with(params, trial))
          if e < best - 1e-12:
            best, values = e, trial
        span /= 5
  fitted = _with(params, values)
  out = {k: comp[k] for k in COMPONENTS if k in comp}
  for k in PER_OP:
    if "[" not in k and hasattr(fitted, k):
      out[k] = float(f"{getattr(fitted, k):.3g}")
  out["contention"] = [[c, float(f"{a:.3g}"), float(f"{b:.3g}")]
                       for c, a, b in fitted.contention]
  out["receive_bw"] = [float(f"{b:.4g}") for b in fitted.receive_bw]
  out["p2p_bw"] = float(f"{out['p2p_bw']:.4g}")
  out["p2p_latency_s"] = float(f"{out['p2p_latency_s']:.3g}")
  return {"params": out,
          "error": fit_error(cases, device_params.params_for(
              kind, overrides=out)),
          "objective": "squared log error per schedule, case mean removed,"
                       " compute='xla' schedules"}


def fit_decomposition_scale(cases, params) -> float:
  """``decomposition_scale`` minimizing `fit_error` on ``cases`` (grid 0.02).

  The one structural term the schedule benchmarks pin down well: how much
  of the characterised per-piece loss the schedules' pieces really lose.
  ``params`` must carry no calibration.
  """
  grid = [i / 50 for i in range(0, 76)]
  errs = [fit_error(cases, dataclasses.replace(params, decomposition_scale=g))
          for g in grid]
  return grid[min(range(len(grid)), key=errs.__getitem__)]


def fit_calibration(cases, params, *, min_samples: int = 4,
                    ridge: float = 1.0) -> list[list]:
  """Per schedule family, the correction ``t * exp(a + b ln(t / 1 ms))``.

  For every (op, dataflow, num_chunks, comm) with at least ``min_samples``
  measured cases (compute='xla', what the heuristic returns): least squares
  of ``ln(measured / predicted)`` on ``ln(predicted / 1 ms)``, the slope
  shrunk toward 0 by ``ridge`` (so a family measured over a narrow size
  range is corrected by a constant, not extrapolated) and clipped to
  [-0.5, 0.5]. ``params`` must carry no calibration of its own.

  Returns:
    ``[[op, dataflow, num_chunks, comm, a, b], ...]`` for
    ``DeviceParams.calibration``.
  """
  cost_model = _cost_model()
  samples = {}
  for c in cases:
    prob = c.problem()
    for s, ms in c.times:
      if s.compute != "xla":
        continue
      t = cost_model.predict_uncalibrated(prob, s, params).total * 1e3
      key = (prob.op, cost_model.family(prob.op, s), s.num_chunks,
             s.comm if s.overlapped else "xla")
      samples.setdefault(key, []).append((math.log(t), math.log(ms / t)))
  out = []
  for key, pts in sorted(samples.items()):
    if len(pts) < min_samples:
      continue
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    b = max(-0.5, min(0.5, sxy / (sxx + ridge)))
    a = my - b * mx
    out.append([*key, float(f"{a:.4g}"), float(f"{b:.4g}")])
  return out


