"""How often the cost-model heuristic picks the measured best schedule.

Input: benchmark results, either ag_bench.py / rs_bench.py JSON (``cases``
with ``name``, ``W``, ``M``, ``K``, ``N``, ``baselines.xla`` and ``methods``
of ``{"method": "ficco", "label": "<dataflow>/c<n>/<comm>/<compute>",
"median_ms"}``), or the minimal form
``{"op": ..., "cases": [{"name", "M", "K", "N", "axis_size",
"schedules": {"<label>": median_ms}}]}``. A file given as ``PATH:MEMBER``
is member ``MEMBER`` of a bundle (``all_results.json`` of run_gpu.sh maps
file names to their contents). M, K, N are global; the local shapes follow
ag_bench (x [M/W, K], w [K, N/W]) or rs_bench (h [M, K/W], w [K/W, N]).
Each (run, case) is one case; the run is the folder the file lies in.

Split (stated, not tuned): cases of the --holdout_models families and of
the --holdout_tokens token counts are held out; the rest is the fit split.
Fit (``fit_cost_model.fit_benchmarks``, fit split only): the per-op terms
of the cost model, from every measured schedule of the fit split, on top of
the component parameters fitted from --characterization.

Report, on held-out cases (and on the fit split, for contrast): the
fraction of cases where the heuristic's pick is within --tolerance of the
best measured schedule, and sum(pick time) / sum(best time); for the
built-in parameters (what ships) and freshly fitted ones. The pick is the
heuristic's choice among the measured schedules it can return
(``cost_model.candidates``: compute="xla"); the best is over every measured
schedule (Pallas compute included). The noise floor: the same schedule
measured twice in one run, and in two runs; how often the best schedule
changes between two runs, and how an oracle that re-uses one run's best
scores in the other run.

  pip install -q . && python3 benchmarks/heuristic_accuracy.py

(the committed inputs by default; the model is the installed package's).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # After the installed package.

import fit_cost_model  # noqa: E402  (defines --characterization)

from ficco_jax._src import cost_model  # noqa: E402
from ficco_jax._src import device_params  # noqa: E402
from ficco_jax._src import heuristics  # noqa: E402
from ficco_jax._src import schedule as schedule_lib  # noqa: E402

CALIBRATION_COMMENT = (
    "Family calibration of the cost model (DeviceParams.calibration), fitted"
    " by benchmarks/heuristic_accuracy.py --calibration_out on the fit split"
    " of {inputs} (held out: models {models}, tokens {tokens}; labels:"
    " {stat}).")
RESULTS = "benchmarks/results"
# Interleaved sweeps (timing.interleaved), session 4's inputs (session 5's
# protocol changes came after them; its M = 2048 re-measurements are added
# with --latest_only, benchmarks/results/accuracy_session5): the
# reduce-scatter measured after session 4's sync call changed its
# copy-engine schedules (calls A and B), the all-gather in session 3 (its
# programs did not change since); every model at M = 2048 / 4096 / 8192 /
# 16384 and the square cases. The shipped calibration was fitted on the
# session-3 sweeps' fit split (its "comment" names them), before the
# session-4 reduce-scatter cases existed.
DEFAULT_RESULTS = [
    f"{RESULTS}/h200x4_session4_a/rs_w4_sync.json",
    f"{RESULTS}/h200x4_session3_d/ag_w4_sweep.json",
    f"{RESULTS}/h200x4_session4_b/rs_w4_sweep_m2048.json",
    f"{RESULTS}/h200x4_session4_b/rs_w4_sweep_m16384.json",
    f"{RESULTS}/h200x4_session3_e/ag_w4_sweep2.json",
]

FLAGS = flags.FLAGS
flags.DEFINE_list("results", DEFAULT_RESULTS,
                  "Result JSON files (PATH or PATH:MEMBER), relative to the"
                  " repository root or absolute.")
flags.DEFINE_string("device_kind", None,
                    "Device kind (default: the results' meta.device_kind).")
flags.DEFINE_list("holdout_models", ["qwen2-72b", "gpt3-175b"],
                  "Held-out model families.")
flags.DEFINE_list("holdout_tokens", [], "Held-out token counts M.")
flags.DEFINE_float("tolerance", 0.03, "A pick within this of the best counts.")
flags.DEFINE_string("calibration_out", None,
                    "Write the family calibration fitted on the fit split"
                    " here (ficco_jax/data/cost_model/<kind>.json ships it).")
flags.DEFINE_enum("stat", "min_ms", ["median_ms", "min_ms"],
                  "Which per-schedule time is the label: the median over"
                  " rounds, or the fastest round (less noisy; see the noise"
                  " section).")
flags.DEFINE_string("out_dir", os.path.join(HERE, "results"), "Output folder.")
flags.DEFINE_bool("latest_only", False,
                  "A case (op, shape, axis size) measured in several inputs:"
                  " score only the last input's run (later sweeps re-measured"
                  " it on newer code) instead of every run.")

ROOT = os.path.dirname(HERE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  name: str
  op: str
  m: int
  k: int
  n: int
  p: int
  times: tuple[tuple[schedule_lib.Schedule, float], ...]
  run: str = ""
  # XLA's collective + dot as the harness's baseline, when the case also
  # timed dataflow "none" (the same program) explicitly. The labels keep one
  # timing per schedule ("none"'s own), so no schedule gets two draws; the
  # autotune cache's rule uses the faster of the two, to stay on XLA's
  # program where a win is doubtful.
  xla_ms: float | None = None

  @property
  def model(self) -> str:
    return self.name.split("/")[0]

  @property
  def label(self) -> str:
    short = {"all_gather_matmul": "ag", "matmul_reduce_scatter": "rs"}
    return " ".join(x for x in (self.run, short.get(self.op, self.op),
                                self.name) if x)

  def problem(self) -> cost_model.Problem:
    if self.op == "all_gather_matmul":
      x, w = (self.m // self.p, self.k), (self.k, self.n // self.p)
    else:
      x, w = (self.m, self.k // self.p), (self.k // self.p, self.n)
    return cost_model.problem(self.op, x_shape=x, w_shape=w, dtype="bfloat16",
                              axis_size=self.p)


def parse_label(label: str) -> schedule_lib.Schedule | None:
  parts = label.split()[0].split("/") if label.strip() else []
  if len(parts) < 4 or not parts[1].startswith("c"):
    return None  # "default", Mosaic configs, ...
  try:
    return schedule_lib.Schedule.from_short(label.split()[0])
  except (ValueError, TypeError):
    return None


def _read(spec: str) -> tuple[dict, str]:
  """(JSON of ``PATH`` or of member ``MEMBER`` of ``PATH:MEMBER``, run tag)."""
  path, _, member = spec.partition(":")
  if not os.path.isabs(path) and not os.path.exists(path):
    path = os.path.join(ROOT, path)
  with open(path) as f:
    data = json.load(f)
  if member:
    data = data[member]
  run = os.path.basename(os.path.dirname(os.path.abspath(path)))
  return data, run.replace("h200x4_", "")


def load(paths, duplicates: list | None = None,
         stat: str | None = None) -> tuple[list[Case], str | None]:
  """Cases with at least two measured schedules, and the device kind.

  Each schedule's time is its ``stat`` (``"median_ms"`` or ``"min_ms"``;
  None: --stat). A ``"default"`` method (schedule=None) counts as a measurement of the
  schedule it resolved to when the case has no explicit one; otherwise the
  pair goes to ``duplicates`` as ``(case label, schedule, explicit ms,
  default ms)``: the same program timed twice in one run.
  """
  stat = stat or FLAGS.stat
  cases, kind = [], None
  for spec in paths:
    data, run = _read(spec)
    meta = data.get("meta", {})
    kind = kind or meta.get("device_kind")
    op = data.get("op") or meta.get("op") or "all_gather_matmul"
    # ag_bench.py / rs_bench.py write the short names.
    op = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}.get(op, op)
    for c in data.get("cases", []):
      times, defaults = {}, {}
      if "schedules" in c:
        for label, ms in c["schedules"].items():
          s = parse_label(label)
          if s and ms:
            times[s] = float(ms)
      for mth in c.get("methods", []):
        if (mth.get("method") != "ficco" or not mth.get(stat)
            or mth.get("ok", True) is False):
          continue
        s = parse_label(mth.get("label", ""))
        if s:
          times[s] = float(mth[stat])
        elif mth.get("label") == "default":
          s = parse_label(mth.get("resolved") or "")
          if s:
            defaults[s] = float(mth[stat])
      xla = c.get("baselines", {}).get("xla", {}).get(stat)
      explicit_none = schedule_lib.NO_OVERLAP in times
      if xla and not explicit_none:
        # XLA's collective + dot in shard_map is exactly dataflow "none".
        times[schedule_lib.NO_OVERLAP] = float(xla)
      case = Case(name=c.get("name", "?"), op=op, m=int(c["M"]),
                  k=int(c["K"]), n=int(c["N"]),
                  p=int(c.get("W", c.get("axis_size", 0))), times=(),
                  run=run,
                  xla_ms=float(xla) if xla and explicit_none else None)
      for s, ms in defaults.items():
        if s in times:
          if duplicates is not None:
            duplicates.append((case.label, s.short(), times[s], ms))
        else:
          times[s] = ms
      if len(times) >= 2:
        cases.append(dataclasses.replace(case, times=tuple(times.items())))
  return cases, kind


def keep_latest(cases: list[Case]) -> list[Case]:
  """Of the runs of one (op, shape, axis size), only the last input's."""
  last = {}
  for c in cases:
    last[(c.op, c.name, c.m, c.k, c.n, c.p)] = c.run
  return [c for c in cases if c.run == last[(c.op, c.name, c.m, c.k, c.n,
                                             c.p)]]


def pickable(case: Case) -> bool:
  """Whether at least two measured schedules are ones the heuristic returns
  (else there is no choice to score: e.g. a run that timed only a Pallas
  schedule=None against XLA)."""
  allowed = set(cost_model.candidates(case.problem(), heuristics.COMMS))
  return sum(s in allowed for s, _ in case.times) >= 2


def split(cases, holdout_models=None, holdout_tokens=None):
  """(fit cases, held-out cases) by model family and token count."""
  models = set(holdout_models if holdout_models is not None
               else FLAGS.holdout_models)
  tokens = {int(t) for t in (holdout_tokens if holdout_tokens is not None
                             else FLAGS.holdout_tokens)}
  held = [c for c in cases if c.model in models or c.m in tokens]
  return [c for c in cases if c not in held], held


def pick(case: Case, params) -> tuple[schedule_lib.Schedule,
                                      schedule_lib.Schedule]:
  """(the heuristic's pick among the measured schedules it can return,
  its pick among all of its candidates, measured or not)."""
  prob = case.problem()
  times = dict(case.times)
  allowed = set(cost_model.candidates(prob, heuristics.COMMS))
  preds = tuple(cost_model.predict(prob, s, params) for s in times
                if s in allowed)
  ok = lambda s: cost_model.eligible(params, case.op, s, case.p)  # noqa: E731
  # The heuristic's own margin (wider where no calibration applies).
  margin = cost_model.min_gain_for(params, case.p)
  free = cost_model.best(cost_model.rank(prob, params, heuristics.COMMS),
                         min_gain=margin, allowed=ok)
  return (cost_model.best(preds, min_gain=margin, allowed=ok).schedule,
          free.schedule)


def evaluate(cases, params, tol: float) -> dict:
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


def noise(cases, duplicates, tol: float) -> dict:
  """Run-to-run and within-run spread of the same measurements."""
  dup = [{"case": c, "schedule": s, "ms": a, "again_ms": b,
          "diff": b / a - 1} for c, s, a, b in duplicates]
  by = collections.defaultdict(dict)
  for c in cases:
    by[(c.op, c.name, c.p)][c.run] = dict(c.times)
  pairs = []
  for key, runs in sorted(by.items()):
    names = sorted(runs)
    for i, a in enumerate(names):
      for b in names[i + 1:]:
        ta, tb = runs[a], runs[b]
        common = [s for s in ta if s in tb]
        if len(common) < 3:
          continue  # A rerun of one schedule against XLA: no ranking.
        pairs.append((key, a, b, ta, tb, common))
  diffs = {"none": [], "dma": []}
  flips = within = n_dir = 0
  num = den = 0.0
  rows = []
  for (op, name, _), a, b, ta, tb, common in pairs:
    for s in common:
      diffs["dma" if s.comm == "dma" else "none"].append(
          abs(math.log(tb[s] / ta[s])))
    best_a = min(common, key=ta.get)
    best_b = min(common, key=tb.get)
    flips += best_a != best_b
    # An oracle that knew one run's best, scored in the other run.
    for told, other in ((best_a, tb), (best_b, ta)):
      ok = other[told] <= min(other[s] for s in common) * (1 + tol)
      within += ok
      n_dir += 1
      num += other[told]
      den += min(other[s] for s in common)
    rows.append({"case": f"{op} {name}", "runs": f"{a} vs {b}",
                 "schedules": len(common), "best_a": best_a.short(),
                 "best_b": best_b.short(), "flip": best_a != best_b})

  def stats(xs):
    if not xs:
      return None
    return {"n": len(xs), "median": statistics.median(xs),
            "mean": statistics.fmean(xs), "max": max(xs)}
  return {
      "within_run_duplicates": dup,
      "within_run_abs_diff": stats([abs(math.log(1 + d["diff"]))
                                    for d in dup]),
      "cross_run_abs_log_diff": {k: stats(v) for k, v in diffs.items()},
      "cross_run_cases": len(pairs), "cross_run_best_flips": flips,
      "cross_run_oracle_within_frac": within / n_dir if n_dir else None,
      "cross_run_oracle_time_ratio": num / den if den else None,
      "cross_run_rows": rows,
  }


def _pct(x):
  return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(x):
  return "-" if x is None else f"{x:.3f}"


def markdown(report) -> str:
  tol = report["tolerance"]
  nz = report["noise"]
  fp = report["fit"]
  lines = [
      "# Heuristic accuracy", "",
      f"Command: `{report['command']}`", "",
      f"Results: {', '.join(report['inputs'])}; device kind"
      f" {report['device_kind']!r}. One case = one (run, op, shape).",
      f"Held out: models {report['holdout_models']}, tokens"
      f" {report['holdout_tokens']} ({report['n_held']} cases; fit on"
      f" {report['n_fit']}). Nothing of the held-out cases enters a fit."
      f" Left out (fewer than two measured schedules the heuristic can"
      f" return): {', '.join(report['left_out']) or 'none'}.",
      "Pick: the heuristic's choice among the measured schedules it can"
      " return (compute='xla'); best: the fastest measured schedule (Pallas"
      " compute included).",
      f"Fitted on the fit split ({fp['objective']}):"
      f" {json.dumps(fp['fitted'])}; built-in (shipped) H200 values of the"
      f" same fields: {json.dumps(fp['builtin'])}"
      f" ({'the same' if fp['builtin'] == fp['fitted'] else 'they differ'}).",
      "Params: builtin = what the installed package ships for this device"
      " kind (its family calibration included); uncalibrated = the same"
      " without the calibration; calibrated = uncalibrated with"
      f" decomposition_scale={report['decomposition_scale']} and a family"
      " calibration, both fitted on this fit split"
      " (fit_cost_model.fit_decomposition_scale, fit_calibration);"
      " fitted = the per-op terms refitted (older method).",
      f"Labels: each schedule's `{FLAGS.stat}` over rounds.",
      "",
      f"| params | split | cases | pick within {100 * tol:.0f}% of best |"
      " sum(pick)/sum(best) |",
      "|---|---|---|---|---|"]
  for name in ("builtin", "uncalibrated", "calibrated", "fitted"):
    for part in ("held_out", "fit"):
      r = report[name][part]
      lines.append(f"| {name} | {part} | {r['cases']} |"
                   f" {_pct(r['within_frac'])} | {_ratio(r['time_ratio'])} |")
  held = report["builtin"]["held_out"]
  met = (held["within_frac"] is not None and held["within_frac"] >= 0.9
         and held["time_ratio"] <= 1.03)
  lines += ["", f"Target on held-out cases (>= 90% within {100 * tol:.0f}%,"
            f" sum ratio <= 1.03) with the shipped parameters:"
            f" {'met' if met else 'not met'}"
            f" ({_pct(held['within_frac'])}, {_ratio(held['time_ratio'])})."]
  cr = nz["cross_run_abs_log_diff"]
  wr = nz["within_run_abs_diff"]
  lines += [
      "", "## Noise floor", "",
      f"* Same program twice in one run (an explicit schedule and"
      f" schedule=None resolving to it): {wr['n']} pairs, median |diff|"
      f" {100 * wr['median']:.1f}%, mean {100 * wr['mean']:.1f}%, max"
      f" {100 * wr['max']:.1f}%." if wr else "* No within-run duplicates.",
      f"* Same case and schedule in two runs: XLA's collective + dot"
      f" (`none`, unchanged code) median |diff|"
      f" {100 * cr['none']['median']:.1f}% (max"
      f" {100 * cr['none']['max']:.1f}%, n={cr['none']['n']}); copy-engine"
      f" schedules median {100 * cr['dma']['median']:.1f}% (max"
      f" {100 * cr['dma']['max']:.1f}%, n={cr['dma']['n']}). The runs ran"
      " different revisions of the copy-engine protocol (run 3 after the"
      " spin-wait fix; session2_c after the window-transport commits, and"
      " faster across the board: XLA's `none` too, by a median 7% against"
      " runs 2 and 3), so part of the spread is the code and the machine."
      if cr.get("none") and cr.get("dma") else "* No cross-run pairs.",
      f"* Cases measured in two runs with >= 3 common schedules:"
      f" {nz['cross_run_cases']}; the best schedule differs between the runs"
      f" in {nz['cross_run_best_flips']}. An oracle that takes one run's"
      f" best and is scored in the other run is within {100 * tol:.0f}% of"
      f" that run's best {_pct(nz['cross_run_oracle_within_frac'])} of the"
      f" time, sum ratio {_ratio(nz['cross_run_oracle_time_ratio'])}: the"
      " ceiling a deterministic predictor can expect on data this noisy."
      f" On held-out cases alone: {report['noise_held_out']['cross_run_cases']}"
      f" such cases, {report['noise_held_out']['cross_run_best_flips']}"
      " flip(s), cross-run oracle within"
      f" {_pct(report['noise_held_out']['cross_run_oracle_within_frac'])},"
      " sum ratio"
      f" {_ratio(report['noise_held_out']['cross_run_oracle_time_ratio'])}.",
      "", "| case | runs | common schedules | best (first run) |"
      " best (second run) | flip |", "|---|---|---|---|---|---|"]
  for r in nz["cross_run_rows"]:
    lines.append(f"| {r['case']} | {r['runs']} | {r['schedules']} |"
                 f" `{r['best_a']}` | `{r['best_b']}` |"
                 f" {'yes' if r['flip'] else ''} |")
  for title, part in (("Held-out cases", "held_out"), ("Fit cases", "fit")):
    lines += ["", f"## {title} (built-in parameters)", "",
              "| case | pick | ms (pred) | best | ms (pred) | ok |"
              " heuristic over all candidates |",
              "|---|---|---|---|---|---|---|"]
    for r in report["builtin"][part]["rows"]:
      lines.append(
          f"| {r['case']} | `{r['pick']}` | {r['pick_ms']:.3f}"
          f" ({r['pick_pred_ms']:.3f}) | `{r['best']}` | {r['best_ms']:.3f}"
          f" ({r['best_pred_ms']:.3f}) | {'yes' if r['within'] else 'NO'} |"
          f" `{r['heuristic']}` |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  duplicates = []
  cases, kind = load(FLAGS.results, duplicates)
  kind = FLAGS.device_kind or kind
  if not cases:
    raise SystemExit("No case with at least two measured schedules.")
  base = device_params.params_for(kind)
  noise_all = noise(cases, duplicates, tol := FLAGS.tolerance)
  if FLAGS.latest_only:
    cases = keep_latest(cases)
  unpickable = [c.label for c in cases if not pickable(c)]
  cases = [c for c in cases if pickable(c)]
  fit_cases, held = split(cases)
  fit = fit_cost_model.fit_benchmarks(fit_cases, kind)
  fitted = device_params.params_for(kind, overrides=fit["params"])
  # The component model without any family correction, and with one fitted
  # on this fit split alone (what --calibration_out ships).
  raw = dataclasses.replace(base, calibration=())
  scale = fit_cost_model.fit_decomposition_scale(fit_cases, raw)
  calibration = fit_cost_model.fit_calibration(
      fit_cases, dataclasses.replace(raw, decomposition_scale=scale))
  sizes = {c.p for c in fit_cases}
  if len(sizes) != 1:
    raise SystemExit(f"fit cases span axis sizes {sorted(sizes)}; the"
                     " calibration is fitted at one axis size.")
  axis_size = sizes.pop()
  calibrated = dataclasses.replace(
      raw, decomposition_scale=scale, calibrated_axis_size=axis_size,
      calibration=device_params._coerce("calibration", calibration))  # pylint: disable=protected-access
  if FLAGS.calibration_out:
    with open(FLAGS.calibration_out, "w") as f:
      json.dump({"comment": CALIBRATION_COMMENT.format(
          inputs=", ".join(FLAGS.results), models=FLAGS.holdout_models,
          tokens=FLAGS.holdout_tokens, stat=FLAGS.stat),
                 "params": {"decomposition_scale": scale,
                            "calibration": calibration,
                            "calibrated_axis_size": axis_size}}, f, indent=1)
  # Predictions come from the installed package (like every benchmark
  # script): install the source tree first.
  command = "pip install -q . && python3 benchmarks/heuristic_accuracy.py" + "".join(
      f" {a}" for a in map(shlex.quote, sys.argv[1:]))
  report = {
      "command": command, "inputs": list(FLAGS.results), "device_kind": kind,
      "ficco_jax": getattr(sys.modules.get("ficco_jax"), "__version__",
                           None),
      "holdout_models": FLAGS.holdout_models,
      "holdout_tokens": FLAGS.holdout_tokens, "tolerance": tol,
      "n_fit": len(fit_cases), "n_held": len(held),
      "left_out": unpickable,
      "fit": {"objective": fit["objective"], "error": fit["error"],
              "fitted": fit["params"],
              "builtin": json.loads(json.dumps(
                  {k: getattr(base, k) for k in fit["params"]}))},
      "latest_only": FLAGS.latest_only,
      "noise": noise_all,
      "noise_held_out": noise(held, [], tol),
  }
  report["calibration"] = calibration
  report["decomposition_scale"] = scale
  for name, params in (("builtin", base), ("fitted", fitted),
                       ("uncalibrated", raw), ("calibrated", calibrated)):
    report[name] = {"held_out": evaluate(held, params, tol),
                    "fit": evaluate(fit_cases, params, tol)}
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  stem = os.path.join(FLAGS.out_dir, "heuristic_accuracy")
  with open(stem + ".json", "w") as f:
    json.dump(report, f, indent=1, default=list)
  with open(stem + ".md", "w") as f:
    f.write(markdown(report))
  print(markdown(report))
  print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
  app.run(main)
