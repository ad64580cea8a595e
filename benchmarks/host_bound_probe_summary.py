"""Per-shape ratios of a host_bound_probe.py result: per call and chained.

  python benchmarks/host_bound_probe_summary.py host_bound_TAG.json
"""

from __future__ import annotations

import json
import math
import sys


def _geomean(xs):
  xs = [x for x in xs if x]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(data: dict) -> str:
  """A markdown table: XLA / ficco per call and per chained op.

  Per case, ficco is its first label besides xla, trivial and the chains (a
  run with several labels: see its markdown for the rest).
  """
  lines = ["| case | XLA ms | trivial ms | ficco ms (x) | chained XLA ms/op"
           " | chained ficco ms/op (x) | rel err |",
           "|---|---|---|---|---|---|---|"]
  per_call, chained = [], []
  for rec in data["cases"]:
    by = {m["label"]: m for m in rec["methods"]}
    chain_xla = next((m for l, m in by.items()
                      if l.startswith("chain") and l.endswith(" xla")), {})
    chain_f = next((m for l, m in by.items()
                    if l.startswith("chain") and not l.endswith(" xla")), {})
    ficco = next((m for l, m in by.items()
                  if l not in ("xla", "trivial") and not l.startswith("chain")),
                 {})
    x, f = by.get("xla", {}).get("median_ms"), ficco.get("median_ms")
    cx, cf = chain_xla.get("per_op_ms"), chain_f.get("per_op_ms")
    r1 = x / f if x and f else None
    r2 = cx / cf if cx and cf else None
    per_call.append(r1)
    chained.append(r2)
    fmt = lambda v: f"{v:.3f}" if v else "-"
    err = max((m.get("rel_err_vs_xla") or 0) for m in rec["methods"])
    wrong = " WRONG" if any(m.get("wrong") for m in rec["methods"]) else ""
    lines.append(
        f"| {rec['name']} | {fmt(x)} | {fmt(by.get('trivial', {}).get('median_ms'))}"
        f" | {fmt(f)} ({fmt(r1)}x) | {fmt(cx)} | {fmt(cf)} ({fmt(r2)}x)"
        f" | {err:.4f}{wrong} |")
  cells = []
  for ratios in (per_call, chained):
    g = _geomean(ratios)
    n = sum(1 for r in ratios if r)
    cells.append(f"**{g:.3f}x** ({n} of {len(ratios)})" if g else "-")
  lines.append(f"| **geomean** | | | {cells[0]} | | {cells[1]} | |")
  return "\n".join(lines)


def main(argv):
  for path in argv[1:]:
    with open(path) as f:
      data = json.load(f)
    print(f"# {path}\n")
    print(summarize(data))


if __name__ == "__main__":
  main(sys.argv)
