"""The heuristic suite's markdown, from its JSON alone."""

from __future__ import annotations

import json

from lib import report


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:.0f}%"


def _noise_lines(nz: dict, held: dict, tol: float) -> list[str]:
  wr, cr = nz["within_run_abs_diff"], nz["cross_run_abs_log_diff"]
  lines = ["", "## Noise floor", ""]
  lines.append(
      f"* Same program twice in one run (an explicit schedule and"
      f" schedule=None resolving to it): {wr['n']} pairs, median |diff|"
      f" {100 * wr['median']:.1f}%, mean {100 * wr['mean']:.1f}%, max"
      f" {100 * wr['max']:.1f}%." if wr else "* No within-run duplicates.")
  lines.append(
      f"* Same case and schedule in two runs: XLA's collective + dot"
      f" (`none`) median |diff| {100 * cr['none']['median']:.1f}% (max"
      f" {100 * cr['none']['max']:.1f}%, n={cr['none']['n']}); copy-engine"
      f" schedules median {100 * cr['dma']['median']:.1f}% (max"
      f" {100 * cr['dma']['max']:.1f}%, n={cr['dma']['n']}). Runs of"
      " different library revisions differ by the code too."
      if cr.get("none") and cr.get("dma") else "* No cross-run pairs.")
  lines.append(
      f"* Cases measured in two runs with >= 3 common schedules:"
      f" {nz['cross_run_cases']}; the best schedule differs in"
      f" {nz['cross_run_best_flips']}. An oracle that takes one run's best"
      f" and is scored in the other is within {100 * tol:.0f}% of that run's"
      f" best {_pct(nz['cross_run_oracle_within_frac'])} of the time, sum"
      f" ratio {report.num(nz['cross_run_oracle_time_ratio'])}: the ceiling a"
      f" deterministic predictor can expect on data this noisy. Held-out"
      f" cases alone: {held['cross_run_cases']} such cases,"
      f" {held['cross_run_best_flips']} flip(s), oracle within"
      f" {_pct(held['cross_run_oracle_within_frac'])}, sum ratio"
      f" {report.num(held['cross_run_oracle_time_ratio'])}.")
  lines += [""] + report.table(
      ["case", "runs", "common schedules", "best (first run)",
       "best (second run)", "flip"],
      [[r["case"], r["runs"], r["schedules"], f"`{r['best_a']}`",
        f"`{r['best_b']}`", "yes" if r["flip"] else ""]
       for r in nz["cross_run_rows"]])
  return lines


def markdown(data: dict) -> str:
  tol = data["tolerance"]
  fp = data["fit"]
  lines = ["# Heuristic accuracy", ""]
  lines += report.provenance(data["meta"])
  lines += [
      "",
      f"Labels: {', '.join(data['inputs'])} (each schedule's"
      f" `{data['stat']}` over rounds); device kind"
      f" {data['meta'].get('device_kind')!r}. One case = one (run, op,"
      " shape).",
      f"Held out: models {data['holdout_models']}, tokens"
      f" {data['holdout_tokens']} ({data['n_held']} cases; fit on"
      f" {data['n_fit']}). Left out (fewer than two measured schedules the"
      f" heuristic can return): {', '.join(data['left_out']) or 'none'}.",
      "Pick: the heuristic's choice among the measured schedules it can"
      " return (compute='xla'); best: the fastest measured schedule.",
      f"Fitted on the fit split ({fp['objective']}): {json.dumps(fp['fitted'])};"
      f" the installed package's values of the same fields:"
      f" {json.dumps(fp['builtin'])}.",
      "Params: builtin = what the installed package ships for this device"
      " kind (its family calibration included); uncalibrated = the same"
      " without the calibration; calibrated = uncalibrated with"
      f" decomposition_scale={data['decomposition_scale']} and a family"
      " calibration, both fitted on this fit split (what --calibration_out"
      " writes); fitted = the per-op terms refitted too.",
      ""]
  rows = []
  for name in ("builtin", "uncalibrated", "calibrated", "fitted"):
    for part in ("held_out", "fit"):
      r = data[name][part]
      rows.append([name, part, r["cases"], _pct(r["within_frac"]),
                   report.num(r["time_ratio"])])
  lines += report.table(["params", "split", "cases",
                         f"pick within {100 * tol:.0f}% of best",
                         "sum(pick)/sum(best)"], rows)
  held = data["builtin"]["held_out"]
  met = (held["within_frac"] is not None and held["within_frac"] >= 0.9
         and held["time_ratio"] <= 1.03)
  lines += ["", f"Target on held-out cases (>= 90% within {100 * tol:.0f}%,"
            f" sum ratio <= 1.03) with the installed parameters:"
            f" {'met' if met else 'not met'} ({_pct(held['within_frac'])},"
            f" {report.num(held['time_ratio'])})."]
  lines += _noise_lines(data["noise"], data["noise_held_out"], tol)
  for title, part in (("Held-out cases", "held_out"), ("Fit cases", "fit")):
    lines += ["", f"## {title} (builtin parameters)", ""]
    lines += report.table(
        ["case", "pick", "ms (pred)", "best", "ms (pred)", "ok",
         "heuristic over all candidates"],
        [[r["case"], f"`{r['pick']}`",
          f"{r['pick_ms']:.3f} ({r['pick_pred_ms']:.3f})", f"`{r['best']}`",
          f"{r['best_ms']:.3f} ({r['best_pred_ms']:.3f})",
          "yes" if r["within"] else "NO", f"`{r['heuristic']}`"]
         for r in data["builtin"][part]["rows"]])
  return "\n".join(lines) + "\n"
