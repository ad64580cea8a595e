"""How often the cost-model heuristic picks the measured best schedule.

Input: benchmark results, either ag_bench.py / rs_bench.py JSON (``cases``
with ``name``, ``W``, ``M``, ``K``, ``N``, ``baselines.xla`` and ``methods``
of ``{"method": "ficco", "label": "<dataflow>/c<n>/<comm>/<compute>",
"median_ms"}``), or the minimal form
``{"op": ..., "cases": [{"name", "M", "K", "N", "axis_size",
"schedules": {"<label>": median_ms}}]}``. M, K, N are global; the local
shapes follow ag_bench (x [M/W, K], w [K, N/W]) or rs_bench
(h [M, K/W], w [K/W, N]).

Split (stated, not tuned): cases of the --holdout_models families and of
the --holdout_tokens token counts are held out; the rest is the fit split.
Fit: ``rows_half`` (the decomposition curve) and the dma/xla contention
factors, by grid search minimising the squared log error of predicted vs
measured time over every measured schedule of the fit split. Report, on
held-out cases (and on the fit split, for contrast): the fraction of cases
where the heuristic's pick among the measured schedules is within 3% of the
best measured one, and sum(pick time) / sum(best time); for the built-in and
the fitted parameters.

  python3 benchmarks/heuristic_accuracy.py \
      --results=benchmarks/results/all_gather_matmul_w4.json
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # After the installed package.

from ficco_jax._src import cost_model  # noqa: E402
from ficco_jax._src import device_params  # noqa: E402
from ficco_jax._src import schedule as schedule_lib  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("results", None, "Result JSON files.")
flags.DEFINE_string("device_kind", None,
                    "Device kind (default: the results' meta.device_kind).")
flags.DEFINE_list("holdout_models", ["gpt3-175b"], "Held-out model families.")
flags.DEFINE_list("holdout_tokens", ["4096"], "Held-out token counts M.")
flags.DEFINE_float("tolerance", 0.03, "A pick within this of the best counts.")
flags.DEFINE_string("out_dir", os.path.join(HERE, "results"), "Output folder.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  name: str
  op: str
  m: int
  k: int
  n: int
  p: int
  times: tuple[tuple[schedule_lib.Schedule, float], ...]

  @property
  def model(self) -> str:
    return self.name.split("/")[0]

  def problem(self) -> cost_model.Problem:
    if self.op == "all_gather_matmul":
      x, w = (self.m // self.p, self.k), (self.k, self.n // self.p)
    else:
      x, w = (self.m, self.k // self.p), (self.k // self.p, self.n)
    return cost_model.problem(self.op, x_shape=x, w_shape=w, dtype="bfloat16",
                              axis_size=self.p)


def parse_label(label: str) -> schedule_lib.Schedule | None:
  parts = label.split("/")
  if len(parts) < 4 or not parts[1].startswith("c"):
    return None  # "default", Mosaic configs, ...
  try:
    kw = dict(dataflow=parts[0], num_chunks=int(parts[1][1:]), comm=parts[2],
              compute=parts[3])
    if len(parts) > 4:
      kw["num_sms"] = int(parts[4][2:])
    return schedule_lib.Schedule(**kw)
  except (ValueError, TypeError):
    return None


def load(paths) -> tuple[list[Case], str | None]:
  cases, kind = [], None
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    meta = data.get("meta", {})
    kind = kind or meta.get("device_kind")
    op = data.get("op") or meta.get("op") or "all_gather_matmul"
    # ag_bench.py / rs_bench.py write the short names.
    op = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}.get(op, op)
    for c in data.get("cases", []):
      times = {}
      if "schedules" in c:
        for label, ms in c["schedules"].items():
          s = parse_label(label)
          if s and ms:
            times[s] = float(ms)
      for mth in c.get("methods", []):
        s = parse_label(mth.get("label", ""))
        if (mth.get("method") == "ficco" and s and mth.get("median_ms")
            and mth.get("ok", True) is not False):
          times[s] = float(mth["median_ms"])
      xla = c.get("baselines", {}).get("xla", {}).get("median_ms")
      if xla and schedule_lib.NO_OVERLAP not in times:
        # XLA's collective + dot in shard_map is exactly dataflow "none".
        times[schedule_lib.NO_OVERLAP] = float(xla)
      if len(times) >= 2:
        cases.append(Case(name=c.get("name", "?"), op=op, m=int(c["M"]),
                          k=int(c["K"]), n=int(c["N"]),
                          p=int(c.get("W", c.get("axis_size", 0))),
                          times=tuple(times.items())))
  return cases, kind


def split(cases):
  models = set(FLAGS.holdout_models)
  tokens = {int(t) for t in FLAGS.holdout_tokens}
  held = [c for c in cases if c.model in models or c.m in tokens]
  return [c for c in cases if c not in held], held


def fit_error(cases, params) -> float:
  err = 0.0
  for c in cases:
    prob = c.problem()
    for s, ms in c.times:
      err += math.log(cost_model.predict(prob, s, params).total * 1e3 / ms) ** 2
  return err


def fit(cases, base):
  rows_half = [8, 16, 32, 64, 128, 256, 512]
  dma = [i / 50 for i in range(0, 26)]
  xla = [0.0, 0.25, 0.5, 1.0, 1.3, 1.6, 2.0, 3.0]
  best, best_err = base, fit_error(cases, base)
  for rh, a, x in itertools.product(rows_half, dma, xla):
    p = dataclasses.replace(base, rows_half=float(rh), decomposition=(),
                            contention=(("dma", a, a), ("xla", x, x)))
    e = fit_error(cases, p)
    if e < best_err:
      best, best_err = p, e
  return best, best_err


def evaluate(cases, params) -> dict:
  rows, within = [], 0
  pick_sum = best_sum = 0.0
  for c in cases:
    prob = c.problem()
    times = dict(c.times)
    preds = tuple(cost_model.predict(prob, s, params) for s in times)
    if schedule_lib.NO_OVERLAP in times:
      pick = cost_model.best(preds).schedule
    else:
      pick = min(preds, key=lambda pr: pr.total).schedule
    oracle = min(times, key=times.get)
    ok = times[pick] <= times[oracle] * (1 + FLAGS.tolerance)
    within += ok
    pick_sum += times[pick]
    best_sum += times[oracle]
    rows.append({"case": c.name, "P": c.p, "pick": pick.short(),
                 "pick_ms": times[pick], "best": oracle.short(),
                 "best_ms": times[oracle], "within": bool(ok)})
  n = len(cases)
  return {"cases": n, "within_frac": within / n if n else None,
          "time_ratio": pick_sum / best_sum if best_sum else None,
          "rows": rows}


def markdown(report) -> str:
  lines = ["# Heuristic accuracy", "",
           f"Results: {', '.join(report['inputs'])}; device kind"
           f" {report['device_kind']!r}.",
           f"Held out: models {report['holdout_models']}, tokens"
           f" {report['holdout_tokens']} ({report['n_held']} cases; fit on"
           f" {report['n_fit']}).",
           f"Fitted: rows_half={report['fit_params']['rows_half']},"
           f" contention={report['fit_params']['contention']}.", "",
           "| params | split | cases | pick within"
           f" {100 * FLAGS.tolerance:.0f}% of best | sum(pick)/sum(best) |",
           "|---|---|---|---|---|"]
  for name in ("builtin", "fitted"):
    for part in ("held_out", "fit"):
      r = report[name][part]
      frac = "-" if r["within_frac"] is None else f"{100 * r['within_frac']:.0f}%"
      ratio = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.3f}"
      lines.append(f"| {name} | {part} | {r['cases']} | {frac} | {ratio} |")
  lines += ["", "Held-out cases (fitted parameters):", "",
            "| case | P | pick | ms | best | ms | ok |", "|---|---|---|---|---|---|---|"]
  for r in report["fitted"]["held_out"]["rows"]:
    lines.append(f"| {r['case']} | {r['P']} | `{r['pick']}` | {r['pick_ms']:.3f}"
                 f" | `{r['best']}` | {r['best_ms']:.3f} |"
                 f" {'yes' if r['within'] else 'NO'} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  cases, kind = load(FLAGS.results)
  kind = FLAGS.device_kind or kind
  if not cases:
    raise SystemExit("No case with at least two measured schedules.")
  base = device_params.params_for(kind)
  fit_cases, held = split(cases)
  fitted, err = fit(fit_cases, base) if fit_cases else (base, None)
  report = {
      "inputs": list(FLAGS.results), "device_kind": kind,
      "holdout_models": FLAGS.holdout_models,
      "holdout_tokens": FLAGS.holdout_tokens,
      "n_fit": len(fit_cases), "n_held": len(held),
      "fit_params": {"rows_half": fitted.rows_half,
                 "contention": [list(c) for c in fitted.contention],
                 "fit_sq_log_error": err},
  }
  for name, params in (("builtin", base), ("fitted", fitted)):
    report[name] = {"held_out": evaluate(held, params),
                    "fit": evaluate(fit_cases, params)}
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  stem = os.path.join(FLAGS.out_dir, "heuristic_accuracy")
  with open(stem + ".json", "w") as f:
    json.dump(report, f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write(markdown(report))
  print(markdown(report))
  print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
  flags.mark_flag_as_required("results")
  app.run(main)
