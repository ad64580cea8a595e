"""The ops suite's derived numbers, markdown and plot (from its JSON alone,
so suite ``report`` can regenerate them)."""

from __future__ import annotations

import json
import os

from lib import gpu_monitor
from lib import report



def timed_ok(m: dict | None) -> bool:
  """A timed record whose result was correct (or not checked)."""
  return bool(m and m.get("median_ms") and m.get("ok", True) is not False)


def summarize_case(c: dict) -> None:
  """Adds the ideal, ``xla_best``, speedups and bests to a case record.

  Speedups are over ``xla_best``: the faster of XLA's correct programs (in
  shard_map, and pjit style with its overlap flags) in the same run.
  """
  b = c["baselines"]
  t_mm = b.get("matmul", {}).get("median_ms")
  t_comm = b.get("comm", {}).get("median_ms")
  ideal = max(t_mm, t_comm) if t_mm and t_comm else None
  xla = {k: v for k, v in c["xla"].items() if timed_ok(v)}
  best = min(xla, key=lambda k: xla[k]["median_ms"]) if xla else None
  c["xla_best"] = None if best is None else {
      "variant": best, "median_ms": xla[best]["median_ms"],
      "min_ms": xla[best]["min_ms"]}
  t_xla = c["xla_best"]["median_ms"] if best else None
  c["ideal_ms"] = ideal
  c["ideal_speedup"] = t_xla / ideal if ideal and t_xla else None
  t_sm = c["xla"].get("shard_map", {}).get("median_ms")
  for m in c["methods"]:
    t = m.get("median_ms")
    if not t:
      continue
    m["speedup"] = t_xla / t if t_xla else None
    m["speedup_min"] = c["xla_best"]["min_ms"] / m["min_ms"] if t_xla else None
    m["speedup_vs_shard_map"] = t_sm / t if t_sm else None
    m["frac_ideal"] = ideal / t if ideal else None
    m["exposed_ms"] = t - t_mm if t_mm else None

  def fastest(method, label=None):
    ok = [m for m in c["methods"] if m["method"] == method and timed_ok(m)
          and (label is None or m["label"] == label)]
    m = min(ok, key=lambda m: m["median_ms"]) if ok else None
    return None if m is None else {
        k: m.get(k) for k in ("label", "median_ms", "min_ms", "speedup",
                              "frac_ideal")}

  c["ficco_default"] = fastest("ficco", "default")
  c["ficco_best"] = fastest("ficco")
  c["mosaic_best"] = fastest("mosaic")


def summary(data: dict) -> dict:
  """Per op and method label: geomean, min and count of speedups < 1.00."""
  out = {}
  for key, op in data["ops"].items():
    by: dict[str, list[float]] = {}
    for c in op["cases"]:
      for m in c["methods"]:
        if timed_ok(m) and m.get("speedup"):
          by.setdefault(f"{m['method']} {m['label']}", []).append(m["speedup"])
      if c.get("ficco_best") and c["ficco_best"].get("speedup"):
        by.setdefault("ficco best", []).append(c["ficco_best"]["speedup"])
    out[key] = [{"method": name, "cases": len(v),
                 "geomean": report.geomean(v), "min": min(v),
                 "below_1": sum(x < 1.0 for x in v)}
                for name, v in by.items()]
  return out


PICK_TOLERANCE = 0.03  # "within 3% of the fastest schedule measured".
XLA_TOLERANCE = 0.02   # "never more than 2% slower than XLA".


def accuracy(cases: list[dict]) -> dict | None:
  """How schedule=None ("default") fares against the other ficco schedules
  measured in the same run, over the cases where it and at least one other
  ran correctly (None: no such case). The fastest includes "default" and
  "none" (XLA's own program inside ficco)."""
  rows, retimed = [], 0
  for c in cases:
    ok = [m for m in c["methods"] if m["method"] == "ficco" and timed_ok(m)]
    default = next((m for m in ok if m["label"] == "default"), None)
    if default is None or len(ok) < 2:
      continue
    speedup = default.get("speedup")
    again = [m for m in ok if timed_ok(m.get("retime"))]
    if timed_ok(default.get("retime")) and len(again) >= 2:
      # Scored on the second pass (``--retime_top``): the first pass's
      # fastest, and schedule=None, timed again side by side.
      retimed += 1
      ok = [dict(m, median_ms=m["retime"]["median_ms"]) for m in again]
      default = next(m for m in ok if m["label"] == "default")
      # XLA at its best in the second pass: the faster of its programs
      # that were correct in the first (the same ones xla_best picks from).
      xla = [v["retime"] for v in c["xla"].values()
             if timed_ok(v) and timed_ok(v.get("retime"))]
      speedup = (min(x["median_ms"] for x in xla) / default["median_ms"]
                 if xla else None)
    best = min(ok, key=lambda m: m["median_ms"])
    rows.append({"case": c["name"], "resolved": c.get("resolved"),
                 "reason": c.get("resolved_reason", ""),
                 "ratio": default["median_ms"] / best["median_ms"],
                 "best": best["label"], "default_ms": default["median_ms"],
                 "best_ms": best["median_ms"], "speedup": speedup})
  if not rows:
    return None
  return {
      "cases": len(rows), "retimed": retimed,
      "within": sum(r["ratio"] <= 1 + PICK_TOLERANCE for r in rows),
      "total_ratio": (sum(r["default_ms"] for r in rows)
                      / sum(r["best_ms"] for r in rows)),
      "slower_than_xla": [r["case"] for r in rows if r["speedup"] is not None
                          and r["speedup"] < 1 - XLA_TOLERANCE],
      "misses": [r for r in rows if r["ratio"] > 1 + PICK_TOLERANCE],
  }


def _accuracy_lines(cases: list[dict]) -> list[str]:
  a = accuracy(cases)
  if a is None:
    return []
  again = (f"; on {a['retimed']} of them scored on a second round-robin of"
           " schedule=None, the fastest schedules of the first and XLA's"
           " programs, xla_best of that pass (`--retime_top`)"
           if a["retimed"] else "")
  lines = ["", f"schedule=None against every schedule measured ({a['cases']}"
           f" cases{again}): within {100 * PICK_TOLERANCE:.0f}% of the"
           f" fastest on"
           f" {a['within']} ({100 * a['within'] / a['cases']:.0f}%); total"
           f" time {a['total_ratio']:.3f}x the fastest's; more than"
           f" {100 * XLA_TOLERANCE:.0f}% slower than xla_best on"
           f" {len(a['slower_than_xla'])}"
           + (f" ({', '.join(a['slower_than_xla'])})"
              if a["slower_than_xla"] else "") + "."]
  if a["misses"]:
    lines += ["", "Misses (schedule=None ran, the fastest was):", ""]
    lines += report.table(
        ["case", "schedule=None ran", "why", "fastest", "default / fastest"],
        [[r["case"], f"`{r['resolved']}`", r["reason"][:160],
          f"`{r['best']}`", f"{r['ratio']:.3f}"] for r in a["misses"]])
  return lines


def load_peers(path: str) -> dict | None:
  """PyTorch's figures (suite ``peers``) of the same device and W, if any."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _torch_index(peers: dict | None) -> dict:
  out = {}
  for c in (peers or {}).get("cases", []):
    f = (c.get("methods") or [{}])[0]
    out[(c["op"], c["W"], c["M"], c["K"], c["N"])] = {
        "median_ms": f.get("median_ms"), "own_speedup": f.get("speedup"),
        "error": f.get("error")}
  return out


def _speedup(d: dict | None) -> str:
  if not d or not d.get("median_ms"):
    return "-"
  s = f"{d['median_ms']:.3f} ({report.num(d.get('speedup'), 2)}x)"
  return s


def case_line(key: str, c: dict) -> str:
  """One progress line per finished case."""
  xb = c.get("xla_best") or {}
  parts = [f"{key} {c['name']} W={c['W']}:",
           f"xla_best {report.num(xb.get('median_ms'))} ms ({xb.get('variant')})"]
  for name in ("ficco_default", "ficco_best", "mosaic_best"):
    d = c.get(name)
    if d:
      parts.append(f"{name} {d['median_ms']:.3f} ms"
                   f" {report.num(d.get('speedup'), 2)}x [{d['label']}]")
  return " ".join(parts)


def _case_row(key: str, c: dict, torch: dict) -> list[str]:
  t = torch.get((key, c["W"], c["M"], c["K"], c["N"]))
  xb = c.get("xla_best") or {}
  torch_cell = "-"
  if t and t.get("median_ms") and xb.get("median_ms"):
    torch_cell = (f"{t['median_ms']:.3f} ({xb['median_ms'] / t['median_ms']:.2f}x;"
                  f" {report.num(t.get('own_speedup'), 2)}x own)")
  elif t and t.get("error"):
    torch_cell = "error"
  default = _speedup(c.get("ficco_default"))
  if c.get("ficco_default"):
    default += f" = `{c.get('resolved')}`"
  best = c.get("ficco_best")
  errs = [m.get("rel_err") for m in c["methods"] if m.get("rel_err") is not None]
  bad = sum(1 for m in c["methods"] if m.get("ok") is False)
  failed = sum(1 for m in c["methods"] if m.get("error"))
  return [c["name"], f"{c['M']}x{c['K']}x{c['N']}",
          report.times(c["baselines"].get("matmul")),
          report.times(c["baselines"].get("comm")),
          report.times(c["xla"].get("shard_map")),
          report.times(c["xla"].get("overlap")) if "median_ms" in c["xla"].get(
              "overlap", {}) else "-",
          f"{report.num(c.get('ideal_ms'))} ({report.num(c.get('ideal_speedup'), 2)}x)",
          default,
          _speedup(best) + (f" `{best['label']}`" if best else ""),
          _speedup(c.get("mosaic_best")) + (
              f" `{c['mosaic_best']['label']}`" if c.get("mosaic_best") else ""),
          torch_cell,
          report.num(max(errs) if errs else None, 4), f"{bad}/{failed}"]


def _schedule_table(cases: list[dict]) -> list[str]:
  labels = []
  for c in cases:
    for m in c["methods"]:
      if m["label"] not in labels and m["method"] == "ficco":
        labels.append(m["label"])
  if len(labels) < 2:
    return []
  rows = []
  for c in cases:
    cells = {m["label"]: m for m in c["methods"] if m["method"] == "ficco"}
    row = [c["name"]]
    for label in labels:
      m = cells.get(label)
      if not m or not m.get("median_ms"):
        row.append("err" if m and m.get("error") else "-")
      else:
        row.append(f"{report.num(m.get('speedup'), 2)}x"
                   + (" WRONG" if m.get("ok") is False else ""))
    rows.append(row)
  return ["", "Speedup over xla_best per schedule:", ""] + report.table(
      ["case"] + [f"`{l}`" for l in labels], rows)


def markdown(data: dict, peers: dict | None = None) -> str:
  meta = data["meta"]
  torch = _torch_index(peers)
  lines = [f"# Collective matmuls vs XLA, W={data['axis_size']}", ""]
  lines += report.provenance(meta)
  lines += ["", "ms per call, median over rounds (min). Speedup (x):"
            " xla_best's median over the method's. xla_best: the faster"
            " correct XLA program of the same run, XLA's collective + dot in"
            " shard_map or the pjit-style product with XLA's overlap flags"
            " (latency-hiding scheduler, windowed einsum). Ideal:"
            " max(matmul alone, collective alone). torch: PyTorch's fused op"
            " (suite peers) against the same xla_best, and against its own"
            " NCCL + cuBLAS (own)."]
  if torch and peers and peers.get("meta"):
    # Another run (torchrun, CUDA events on rank 0): its ratio to this
    # run's xla_best spans two runs, so it says which.
    pm = peers["meta"]
    lines += ["", f"torch's times come from another run: peers.json,"
              f" {report.provenance(pm)[1].lstrip('- ')}; timed with CUDA"
              " events on rank 0, where this run times host wall-clock over"
              " every device: read its column as a cross-run figure."]
  for key, op in data["ops"].items():
    cases = op["cases"]
    lines += ["", f"## {op['name']}", ""]
    rows = [[s["method"], s["cases"], report.num(s["geomean"]),
             report.num(s["min"]), s["below_1"]]
            for s in data.get("summary", {}).get(key, [])]
    if rows:
      lines += report.table(["method", "cases", "geomean speedup", "min",
                             "below 1.00x"], rows) + [""]
    lines += report.table(
        ["case", "M x K x N", "matmul", "comm", "XLA shard_map",
         "XLA overlap", "ideal (x)", "ficco default (x)", "ficco best (x)",
         "mosaic best (x)", "torch fused (x)", "max rel err", "wrong/failed"],
        [_case_row(key, c, torch) for c in cases])
    lines += _schedule_table(cases)
    lines += _accuracy_lines(cases)
    clocks = gpu_monitor.describe_cases(
        [c.get("gpus_while_timed") for c in cases])
    if clocks:
      lines += ["", f"GPUs during the round-robins (nvidia-smi every 200 ms):"
                f" {clocks}."]
    overlap = {c["xla"].get("overlap", {}).get("skipped") for c in cases} - {None}
    lines += [f"\nXLA overlap not timed: {r}" for r in sorted(overlap)]
    # What would otherwise pass unseen: results nothing checked, and XLA
    # options that this XLA refused (the overlap program then lacks them).
    unchecked = [f"{c['name']} ({c['check_error']})" for c in cases
                 if c.get("check_error")]
    if unchecked:
      lines.append("\nNot checked (the f32 reference failed; no result of"
                   f" these cases was compared with it): {'; '.join(unchecked)}.")
    if data.get("check") is False:
      lines.append("\nNot checked: --nocheck (no result was compared with"
                   " the f32 reference).")
    refused = sorted({o for c in cases
                      for o in (c["xla"].get("overlap", {})
                                .get("options_rejected") or ())})
    if refused:
      lines.append(f"\nXLA overlap built without {', '.join(refused)}: this"
                   " XLA refused them.")
    rebuilt = [c for c in cases
               if "wrong_with_every_option" in c["xla"].get("overlap", {})]
    if rebuilt:
      left_out = rebuilt[0]["xla"]["overlap"].get("left_out", [])
      still = [c["name"] for c in rebuilt
               if c["xla"]["overlap"].get("ok") is False]
      lines.append(
          f"\nXLA overlap was wrong with every overlap option on"
          f" {', '.join(c['name'] for c in rebuilt)}; built again without"
          f" {', '.join(left_out)}, it was "
          + (f"wrong too on {', '.join(still)} (not a baseline there)."
             if still else "right."))
  failures: dict[str, list[str]] = {}
  for key, op in data["ops"].items():
    for c in op["cases"]:
      entries = [dict(m, method=m.get("method", f"xla {v}"), label=m.get("label", ""))
                 for v, m in c["xla"].items()] + c["methods"]
      for m in entries:
        if m.get("error") or m.get("ok") is False:
          msg = m.get("error") or f"WRONG RESULT rel_err={m['rel_err']:.3g}"
          failures.setdefault(msg, []).append(
              f"{key} {c['name']} {m['method']} {m['label']}")
  if failures:
    lines += ["", "Failures:"]
    for msg, where in failures.items():
      lines.append(f"- {len(where)}x `{msg[:300]}`: {', '.join(where[:6])}"
                   + (" ..." if len(where) > 6 else ""))
  lines += report.skipped(data)
  if data.get("png"):
    lines += ["", f"Plot: {data['png']}"]
  return "\n".join(lines) + "\n"


def plot(data: dict, peers: dict | None, path: str) -> str:
  """Speedup bars per case and op into ``path``; returns what happened."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return "no PNG: matplotlib is not installed"
  torch = _torch_index(peers)
  keys = [k for k, op in data["ops"].items() if op["cases"]]
  if not keys:
    return "no PNG: no cases"
  fig, axes = plt.subplots(len(keys), 1, figsize=(12, 4 * len(keys)),
                           squeeze=False)
  series = ("ficco_default", "ficco_best", "mosaic_best", "torch")
  for ax, key in zip(axes[:, 0], keys):
    cases = data["ops"][key]["cases"]
    width = 0.8 / len(series)
    for j, name in enumerate(series):
      vals = []
      for c in cases:
        if name == "torch":
          t = torch.get((key, c["W"], c["M"], c["K"], c["N"])) or {}
          xb = (c.get("xla_best") or {}).get("median_ms")
          vals.append(xb / t["median_ms"] if xb and t.get("median_ms") else 0)
        else:
          vals.append((c.get(name) or {}).get("speedup") or 0)
      ax.bar([i + j * width for i in range(len(cases))], vals, width,
             label=name)
    ax.scatter([i + 0.4 - width / 2 for i in range(len(cases))],
               [c.get("ideal_speedup") or 0 for c in cases], marker="_",
               s=400, color="k", label="ideal")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([c["name"] for c in cases], rotation=30, ha="right",
                       fontsize=8)
    ax.set_ylabel("speedup over xla_best")
    ax.set_title(f"{data['ops'][key]['name']}, W={data['axis_size']},"
                 f" {data['meta'].get('device_kind')}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return os.path.basename(path)
