"""Suite ``compare``: the before/after regression check of two ops results.

``--inputs=a.json,b.json`` (suite ``ops``, e.g. the previous release and this
one on the same machine). Per op, case and ficco schedule label measured in
both: the ratio of b's speedup over its own xla_best to a's. Each speedup is
against XLA measured in the same run, so the ratio cancels the machine's
drift between the runs; a ratio below ``1 - --tolerance`` flags the case as
slower in b.
"""

from __future__ import annotations

import json
import os

from absl import flags

from lib import meta as meta_lib
from lib import report
from lib import results

FLAGS = flags.FLAGS
flags.DEFINE_list("inputs", [], "Two ops results: before.json,after.json.")
flags.DEFINE_float("tolerance", 0.02, "Flag ratios below 1 - tolerance.")


def _index(data: dict) -> dict:
  """{(op, W, M, K, N, label): (case name, speedup, xla_best ms)}."""
  out = {}
  for key, op in data["ops"].items():
    for c in op["cases"]:
      xb = (c.get("xla_best") or {}).get("median_ms")
      for m in c["methods"]:
        if m.get("speedup") and m.get("ok", True) is not False:
          out[(key, c["W"], c["M"], c["K"], c["N"],
               f"{m['method']} {m['label']}")] = (c["name"], m["speedup"], xb)
  return out


def compare(a: dict, b: dict, tolerance: float) -> dict:
  ia, ib = _index(a), _index(b)
  rows = []
  for k in ia:
    if k not in ib:
      continue
    name, sa, xa = ia[k]
    _, sb, xb = ib[k]
    ratio = sb / sa
    rows.append({"op": k[0], "case": name, "W": k[1],
                 "shape": f"{k[2]}x{k[3]}x{k[4]}", "method": k[5],
                 "speedup_a": sa, "speedup_b": sb, "ratio": ratio,
                 "xla_best_ms_a": xa, "xla_best_ms_b": xb,
                 "slower": ratio < 1 - tolerance})
  summary = {}
  for op in sorted({r["op"] for r in rows}):
    for method in sorted({r["method"] for r in rows if r["op"] == op}):
      rs = [r["ratio"] for r in rows if r["op"] == op and r["method"] == method]
      summary.setdefault(op, []).append({
          "method": method, "cases": len(rs), "geomean": report.geomean(rs),
          "min": min(rs), "slower": sum(r < 1 - tolerance for r in rs)})
  return {"rows": rows, "summary": summary,
          "only_in_a": sorted(" ".join(map(str, k)) for k in set(ia) - set(ib)),
          "only_in_b": sorted(" ".join(map(str, k)) for k in set(ib) - set(ia))}


def markdown(data: dict) -> str:
  a, b = data["a"], data["b"]
  lines = ["# Before/after: ops speedups over xla_best", ""]
  lines += report.provenance(data["meta"])
  for tag, m in (("a", a), ("b", b)):
    package = (f", package {m['package_commit']}" if m.get("package_commit")
               else "")
    lines.append(f"- {tag}: `{report.shown_command(m['path'])}`: ficco_jax"
                 f" {m.get('ficco_jax')}"
                 f" ({report.where_installed(m.get('ficco_jax_file'))}),"
                 f" commit {m.get('git_commit')}{package},"
                 f" {m.get('device_count')} x {m.get('device_kind')},"
                 f" jax {m.get('jax')}, {m.get('date')}")
  tol = data["tolerance"]
  lines += ["", f"ratio = b's speedup / a's (each over its own run's"
            f" xla_best); flagged below {1 - tol:.2f}.", ""]
  for op, rows in data["summary"].items():
    lines += [f"## {op}", ""]
    lines += report.table(["method", "cases", "geomean ratio", "min",
                           f"slower than {1 - tol:.2f}"],
                          [[r["method"], r["cases"], report.num(r["geomean"]),
                            report.num(r["min"]), r["slower"]] for r in rows])
    lines += [""] + report.table(
        ["case", "W", "M x K x N", "method", "a (x)", "b (x)", "ratio",
         "xla_best ms a / b", ""],
        [[r["case"], r["W"], r["shape"], r["method"],
          report.num(r["speedup_a"], 2), report.num(r["speedup_b"], 2),
          report.num(r["ratio"]),
          f"{report.num(r['xla_best_ms_a'])} / {report.num(r['xla_best_ms_b'])}",
          "SLOWER" if r["slower"] else ""]
         for r in data["rows"] if r["op"] == op]) + [""]
  for tag in ("only_in_a", "only_in_b"):
    if data[tag]:
      lines.append(f"{tag}: {', '.join(data[tag][:20])}")
  return "\n".join(lines) + "\n"


def run() -> int:
  if len(FLAGS.inputs) != 2:
    raise ValueError("--inputs needs two ops results: before.json,after.json")
  loaded = []
  for path in FLAGS.inputs:
    with open(path) as f:
      loaded.append(json.load(f))
  a, b = loaded
  data = {"meta": meta_lib.collect("compare", devices=False),
          "tolerance": FLAGS.tolerance,
          "a": dict(a["meta"], path=FLAGS.inputs[0]),
          "b": dict(b["meta"], path=FLAGS.inputs[1]),
          **compare(a, b, FLAGS.tolerance)}
  directory = FLAGS.out_dir or os.path.dirname(os.path.abspath(FLAGS.inputs[1]))
  rec = results.Recorder("compare", directory, data, markdown)
  rec.finish()
  slower = [r for r in data["rows"] if r["slower"]]
  for r in slower:
    print(f"SLOWER: {r['op']} {r['case']} {r['method']} ratio"
          f" {r['ratio']:.3f}", flush=True)
  print(f"{len(data['rows'])} comparisons, {len(slower)} slower than"
        f" {1 - FLAGS.tolerance:.2f}", flush=True)
  return 0
