"""Suite ``heuristic``: how often schedule=None's cost model picks the best.

Input: measured labels (``--labels``, lib/labels.py; default: the sweeps the
shipped calibration was fitted on, benchmarks/data/README.md). Split
(stated, not tuned): cases of the ``--holdout_models`` families and the
``--holdout_tokens`` token counts are held out; the rest is the fit split.
Nothing of the held-out cases enters a fit.

Reported on held-out cases (and on the fit split, for contrast): the
fraction of cases where the heuristic's pick is within ``--pick_tolerance``
of the best measured schedule, and sum(pick time) / sum(best time), for the
installed package's parameters and for parameters fitted here
(lib/fit.py). The pick is the heuristic's choice among the measured
schedules it can return (compute="xla"); the best is over every measured
schedule. The noise floor: the same schedule measured twice in one run and
in two runs; how often the best schedule changes between runs, and how an
oracle that re-uses one run's best scores in the other.

``--calibration_out=PATH`` writes the family calibration fitted on the fit
split: the file the package ships as ficco_jax/data/cost_model/<kind>.json.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import statistics

from absl import flags

from lib import fit as fit_lib
from lib import internal
from lib import labels as labels_lib
from lib import meta as meta_lib
from lib import results
from suites import heuristic_report

FLAGS = flags.FLAGS
DATA = "benchmarks/data"
# The interleaved sweeps of both ops at P=4 the shipped calibration was
# fitted on (benchmarks/data/README.md).
CALIBRATION_LABELS = [
    f"{DATA}/labels_h200_w4_rs_ten_1.json",
    f"{DATA}/labels_h200_w4_ag_ten_1.json",
    f"{DATA}/labels_h200_w4_rs_m2048_m16384.json",
    f"{DATA}/labels_h200_w4_ag_m2048_m16384.json",
]
CHARACTERIZATION = f"{DATA}/characterize_h200_w4.json"
CALIBRATION_COMMENT = (
    "Family calibration of the cost model (DeviceParams.calibration), fitted"
    " by `python benchmarks/bench.py --suite=heuristic --calibration_out=...`"
    " on the fit split of {inputs} (held out: models {models}, tokens"
    " {tokens}; labels: {stat}).")

flags.DEFINE_list("labels", [],
                  "heuristic, autotune: measured labels, PATH or PATH:MEMBER"
                  " (ops results or the files under benchmarks/data/).")
flags.DEFINE_string("label_device_kind", None,
                    "heuristic, autotune: the device kind (default: the"
                    " labels' meta.device_kind).")
flags.DEFINE_list("holdout_models", ["qwen2-72b", "gpt3-175b"],
                  "heuristic: held-out model families.")
flags.DEFINE_list("holdout_tokens", [], "heuristic: held-out token counts M.")
flags.DEFINE_float("pick_tolerance", 0.03,
                   "heuristic: a pick within this of the best counts.")
flags.DEFINE_string("calibration_out", None,
                    "heuristic: write the family calibration fitted on the"
                    " fit split here.")
flags.DEFINE_enum("stat", "min_ms", ["median_ms", "min_ms"],
                  "heuristic: the label of a schedule: its median over"
                  " rounds or its fastest round (less noisy).")
flags.DEFINE_bool("latest_only", False,
                  "heuristic: a case measured in several inputs is scored on"
                  " the last input's run only.")
flags.DEFINE_string("characterization", CHARACTERIZATION,
                    "heuristic: the characterize result the component"
                    " parameters are fitted from.")


def _tuning():
  return (internal.tuning("cost_model"), internal.tuning("device_params"),
          internal.tuning("heuristics"))


def pickable(case) -> bool:
  """Whether at least two measured schedules are ones the heuristic returns
  (else there is no choice to score)."""
  cost_model, _, heuristics = _tuning()
  allowed = set(cost_model.candidates(case.problem(), heuristics.COMMS))
  return sum(s in allowed for s, _ in case.times) >= 2


def split(cases):
  """(fit cases, held-out cases) by model family and token count."""
  models = set(FLAGS.holdout_models)
  tokens = {int(t) for t in FLAGS.holdout_tokens}
  held = [c for c in cases if c.model in models or c.m in tokens]
  return [c for c in cases if c not in held], held


def pick(case, params):
  """(the heuristic's pick among the measured schedules it can return, its
  pick among all of its candidates, measured or not)."""
  cost_model, _, heuristics = _tuning()
  prob = case.problem()
  times = dict(case.times)
  allowed = set(cost_model.candidates(prob, heuristics.COMMS))
  preds = tuple(cost_model.predict(prob, s, params) for s in times
                if s in allowed)
  ok = lambda s: cost_model.eligible(params, case.op, s, case.p)  # noqa: E731
  margin = cost_model.min_gain_for(params, case.p, case.op)  # The heuristic's own.
  free = cost_model.best(cost_model.rank(prob, params, heuristics.COMMS),
                         min_gain=margin, allowed=ok)
  return (cost_model.best(preds, min_gain=margin, allowed=ok).schedule,
          free.schedule)


def evaluate(cases, params, tol: float) -> dict:
  cost_model, _, _ = _tuning()
  rows, within = [], 0
  pick_sum = best_sum = 0.0
  for c in cases:
    times = dict(c.times)
    chosen, free = pick(c, params)
    prob = c.problem()
    oracle = min(times, key=times.get)
    ok = times[chosen] <= times[oracle] * (1 + tol)
    within += ok
    pick_sum += times[chosen]
    best_sum += times[oracle]
    rows.append({
        "case": c.label, "P": c.p, "pick": chosen.short(),
        "pick_ms": times[chosen],
        "pick_pred_ms": cost_model.predict(prob, chosen, params).total * 1e3,
        "best": oracle.short(), "best_ms": times[oracle],
        "best_pred_ms": cost_model.predict(prob, oracle, params).total * 1e3,
        "heuristic": free.short(), "within": bool(ok)})
  n = len(cases)
  return {"cases": n, "within_frac": within / n if n else None,
          "time_ratio": pick_sum / best_sum if best_sum else None,
          "rows": rows}


def _stats(xs):
  if not xs:
    return None
  return {"n": len(xs), "median": statistics.median(xs),
          "mean": statistics.fmean(xs), "max": max(xs)}


def noise(cases, duplicates, tol: float) -> dict:
  """Run-to-run and within-run spread of the same measurements."""
  dup = [{"case": c, "schedule": s, "ms": a, "again_ms": b,
          "diff": b / a - 1} for c, s, a, b in duplicates]
  by = collections.defaultdict(dict)
  for c in cases:
    by[(c.op, c.name, c.p)][c.run] = dict(c.times)
  diffs = {"none": [], "dma": []}
  flips = within = n_dir = 0
  num = den = 0.0
  rows = []
  for (op, name, _), runs in sorted(by.items()):
    names = sorted(runs)
    for i, a in enumerate(names):
      for b in names[i + 1:]:
        ta, tb = runs[a], runs[b]
        common = [s for s in ta if s in tb]
        if len(common) < 3:
          continue  # A rerun of one schedule against XLA: no ranking.
        for s in common:
          diffs["dma" if s.comm == "dma" else "none"].append(
              abs(math.log(tb[s] / ta[s])))
        best_a, best_b = min(common, key=ta.get), min(common, key=tb.get)
        flips += best_a != best_b
        # An oracle that knew one run's best, scored in the other run.
        for told, other in ((best_a, tb), (best_b, ta)):
          low = min(other[s] for s in common)
          within += other[told] <= low * (1 + tol)
          n_dir += 1
          num += other[told]
          den += low
        rows.append({"case": f"{op} {name}", "runs": f"{a} vs {b}",
                     "schedules": len(common), "best_a": best_a.short(),
                     "best_b": best_b.short(), "flip": best_a != best_b})
  return {
      "within_run_duplicates": dup,
      "within_run_abs_diff": _stats([abs(math.log(1 + d["diff"]))
                                     for d in dup]),
      "cross_run_abs_log_diff": {k: _stats(v) for k, v in diffs.items()},
      "cross_run_cases": len(rows), "cross_run_best_flips": flips,
      "cross_run_oracle_within_frac": within / n_dir if n_dir else None,
      "cross_run_oracle_time_ratio": num / den if den else None,
      "cross_run_rows": rows,
  }


def run() -> int:
  _, device_params, _ = _tuning()
  inputs = FLAGS.labels or CALIBRATION_LABELS
  duplicates = []
  cases, kind = labels_lib.load(inputs, duplicates, stat=FLAGS.stat)
  kind = FLAGS.label_device_kind or kind
  if not cases:
    raise SystemExit("No case with at least two measured schedules.")
  tol = FLAGS.pick_tolerance
  noise_all = noise(cases, duplicates, tol)
  if FLAGS.latest_only:
    cases = labels_lib.keep_latest(cases)
  unpickable = [c.label for c in cases if not pickable(c)]
  cases = [c for c in cases if pickable(c)]
  fit_cases, held = split(cases)
  sizes = {c.p for c in fit_cases}
  if len(sizes) != 1:
    raise SystemExit(f"fit cases span axis sizes {sorted(sizes)}; the"
                     " calibration is fitted at one axis size.")
  axis_size = sizes.pop()
  char, _ = labels_lib.read(FLAGS.characterization)
  base = device_params.params_for(kind)
  fit = fit_lib.fit_benchmarks(fit_cases, kind, char)
  fitted = device_params.params_for(kind, overrides=fit["params"])
  # The component model without any family correction, and with one fitted
  # on this fit split alone (what --calibration_out ships).
  raw = dataclasses.replace(base, calibration=())
  scale = fit_lib.fit_decomposition_scale(fit_cases, raw)
  calibration = fit_lib.fit_calibration(
      fit_cases, dataclasses.replace(raw, decomposition_scale=scale))
  calibrated = dataclasses.replace(
      raw, decomposition_scale=scale, calibrated_axis_size=axis_size,
      calibration=device_params._coerce("calibration", calibration))  # pylint: disable=protected-access
  if FLAGS.calibration_out:
    results.write_json(FLAGS.calibration_out, {
        "comment": CALIBRATION_COMMENT.format(
            inputs=", ".join(inputs), models=FLAGS.holdout_models,
            tokens=FLAGS.holdout_tokens, stat=FLAGS.stat),
        "params": {"decomposition_scale": scale, "calibration": calibration,
                   "calibrated_axis_size": axis_size}})
    print(f"wrote {FLAGS.calibration_out}", flush=True)
  data = {
      "meta": dict(meta_lib.collect("heuristic", devices=False),
                   device_kind=kind),
      "inputs": list(inputs), "characterization": FLAGS.characterization,
      "stat": FLAGS.stat, "holdout_models": FLAGS.holdout_models,
      "holdout_tokens": FLAGS.holdout_tokens, "tolerance": tol,
      "n_fit": len(fit_cases), "n_held": len(held), "left_out": unpickable,
      "fit": {"objective": fit["objective"], "error": fit["error"],
              "fitted": fit["params"],
              "builtin": json.loads(json.dumps(
                  {k: getattr(base, k) for k in fit["params"]}))},
      "latest_only": FLAGS.latest_only, "noise": noise_all,
      "noise_held_out": noise(held, [], tol),
      "calibration": calibration, "decomposition_scale": scale,
  }
  for name, params in (("builtin", base), ("fitted", fitted),
                       ("uncalibrated", raw), ("calibrated", calibrated)):
    data[name] = {"held_out": evaluate(held, params, tol),
                  "fit": evaluate(fit_cases, params, tol)}
  directory = results.out_dir(kind, axis_size)
  rec = results.Recorder("heuristic", directory, data,
                         heuristic_report.markdown)
  rec.finish()
  return 0
