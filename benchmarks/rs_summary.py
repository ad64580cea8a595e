"""Prints an rs_bench.py / ag_bench.py JSON's speedups over XLA, per case and
method, then each method's geometric mean over the cases it ran on.

  python3 benchmarks/rs_summary.py out/rs_w4_issue6.json
"""

import json
import math
import sys


def main(path: str) -> None:
  with open(path) as f:
    d = json.load(f)
  logs = {}
  for c in d["cases"]:
    print(c["name"], " ".join(
        f"{m['label']}={m.get('speedup_vs_xla') or 0:.3f}" for m in c["methods"]))
    for m in c["methods"]:
      if m.get("speedup_vs_xla"):
        logs.setdefault(m["label"], []).append(math.log(m["speedup_vs_xla"]))
  for label, v in logs.items():
    print(f"geomean {label}: {math.exp(sum(v) / len(v)):.3f} over {len(v)} shapes")


if __name__ == "__main__":
  main(sys.argv[1])
