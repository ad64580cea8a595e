"""Speedup plots and one summary table from the bench JSONs.

  python benchmarks/plot.py --results_dir=benchmarks/results [--out_dir=...]

Reads every ag_*.json, rs_*.json (ag_bench.py / rs_bench.py) and
torch_*.json (torch_async_tp.py) in --results_dir, matches cases by
(op, W, M, K, N), and writes
  <op>_speedup.png  bars per case: speedup over JAX's XLA collective + dot
                    (T_seq) of ficco's default schedule, ficco's best
                    schedule, Mosaic GPU's best tile config and PyTorch's fused
                    op (T_seq / T_torch, same JAX denominator), with the ideal
                    T_seq / max(T_mm, T_comm) as a marker;
  summary.md        the same numbers as a table, with torch's speedup over its
                    own NCCL + cuBLAS baseline too.
matplotlib is optional: without it only summary.md is written.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}


def load(results_dir: str):
  """{op: {(W, M, K, N): row}} plus the metas read."""
  rows: dict[str, dict[tuple, dict]] = {op: {} for op in OPS}
  metas = []
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    base = os.path.basename(path)
    prefix = base.split("_", 1)[0]
    if prefix not in ("ag", "rs", "torch"):
      continue
    try:
      with open(path) as f:
        data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      print(f"skipping {path}: {e}", file=sys.stderr)
      continue
    metas.append((base, data.get("meta", {}), data.get("in_progress"),
                  data.get("skipped", [])))
    for c in data.get("cases", []):
      op = c.get("op") if prefix == "torch" else prefix
      key = (c["W"], c["M"], c["K"], c["N"])
      row = rows[op].setdefault(key, {"name": c["name"], "W": c["W"]})
      if prefix == "torch":
        f = (c.get("methods") or [{}])[0]
        row["torch_ms"] = f.get("median_ms")
        row["torch_error"] = f.get("error")
        row["torch_own_speedup"] = f.get("speedup_vs_xla")
        row["torch_seq_ms"] = c.get("t_seq_ms")
        row["torch_rel_err"] = f.get("rel_err")
      else:
        row["t_seq_ms"] = c.get("t_seq_ms")
        row["ideal_ms"] = c.get("ideal_ms")
        row["ideal_speedup"] = c.get("ideal_speedup")
        row["mm_ms"] = c["baselines"].get("matmul", {}).get("median_ms")
        row["comm_ms"] = c["baselines"].get("comm", {}).get("median_ms")
        for k in ("ficco_default", "ficco_best", "mosaic_best"):
          row[k] = c.get(k)
        row["default_schedule"] = c.get("default_schedule")
        row["wrong"] = sum(1 for m in c.get("methods", [])
                           if m.get("ok") is False)
  return rows, metas


def _speedups(row):
  """{method: speedup over JAX XLA} for one row (None where missing)."""
  t_seq = row.get("t_seq_ms")

  def sp(d):
    return d.get("speedup_vs_xla") if d else None
  torch_sp = (t_seq / row["torch_ms"]
              if t_seq and row.get("torch_ms") else None)
  return {
      "ficco default": sp(row.get("ficco_default")),
      "ficco best": sp(row.get("ficco_best")),
      "mosaic best": sp(row.get("mosaic_best")),
      "torch fused": torch_sp,
  }


def _fmt(v, spec=".2f", suffix=""):
  return "-" if v is None else f"{v:{spec}}{suffix}"


def summary_md(rows, metas) -> str:
  lines = ["# ficco_jax benchmark summary", ""]
  for base, meta, in_progress, skipped in metas:
    lines.append(
        f"- `{base}`: {meta.get('device_count')} x {meta.get('device_kind')},"
        f" jax {meta.get('jax', '-')}, torch {meta.get('torch', '-')},"
        f" {meta.get('date', '')}"
        + (f"; **stopped during: {in_progress}**" if in_progress else "")
        + (f"; {len(skipped)} skipped" if skipped else ""))
  lines += ["", "Speedup = JAX XLA collective+dot time / method time"
            " (median ms). ideal = T_seq / max(T_mm, T_comm). torch (own) ="
            " torch fused vs NCCL+cuBLAS in torch.", ""]
  for op, title in OPS.items():
    if not rows[op]:
      continue
    lines += [f"## {title}", "",
              "| case | W | M x K x N | T_seq ms | ideal | ficco default |"
              " ficco best | mosaic best | torch fused | torch (own) |"
              " wrong |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows[op], key=lambda k: (-k[0], k[1:])):
      row = rows[op][key]
      sp = _speedups(row)
      best = row.get("ficco_best") or {}
      dflt = row.get("ficco_default") or {}
      dlabel = dflt.get("resolved") or row.get("default_schedule")
      blabel = best.get("label")
      lines.append(
          f"| {row['name']} | {key[0]} | {key[1]}x{key[2]}x{key[3]} |"
          f" {_fmt(row.get('t_seq_ms'), '.3f')} |"
          f" {_fmt(row.get('ideal_speedup'), '.2f', 'x')} |"
          f" {_fmt(sp['ficco default'], '.2f', 'x')}"
          f"{f' `{dlabel}`' if dlabel else ''} |"
          f" {_fmt(sp['ficco best'], '.2f', 'x')}"
          f"{f' `{blabel}`' if blabel else ''} |"
          f" {_fmt(sp['mosaic best'], '.2f', 'x')} |"
          f" {_fmt(sp['torch fused'], '.2f', 'x')} |"
          f" {_fmt(row.get('torch_own_speedup'), '.2f', 'x')} |"
          f" {row.get('wrong', '-')} |")
    lines.append("")
  return "\n".join(lines) + "\n"


def plot(rows, out_dir) -> list[str]:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("plot.py: matplotlib is not installed, so no PNGs were written"
          " (pip install matplotlib); summary.md was still written.",
          file=sys.stderr)
    return []
  written = []
  methods = ["ficco default", "ficco best", "mosaic best", "torch fused"]
  colors = ["#4c72b0", "#55a868", "#dd8452", "#8172b2"]
  for op, title in OPS.items():
    keys = [k for k in sorted(rows[op], key=lambda k: (-k[0], k[1:]))
            if rows[op][k].get("t_seq_ms")]
    if not keys:
      continue
    labels = [f"{rows[op][k]['name']}\nW={k[0]}" for k in keys]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(keys) + 2), 4.8))
    width = 0.8 / len(methods)
    for j, (meth, col) in enumerate(zip(methods, colors)):
      vals = [_speedups(rows[op][k])[meth] for k in keys]
      xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(keys))]
      ax.bar([x for x, v in zip(xs, vals) if v is not None],
             [v for v in vals if v is not None], width, label=meth, color=col)
    ideal = [rows[op][k].get("ideal_speedup") for k in keys]
    ix = [i for i, v in enumerate(ideal) if v is not None]
    if ix:
      ax.hlines([ideal[i] for i in ix], [i - 0.45 for i in ix],
                [i + 0.45 for i in ix], colors="black", lw=1.5, zorder=3,
                label="ideal T_seq / max(T_mm, T_comm)")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speedup over XLA collective + dot")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3, loc="best")
    tops = [v for k in keys for v in _speedups(rows[op][k]).values()
            if v is not None] + [v for v in ideal if v is not None]
    ax.set_ylim(0, 1.3 * max(tops + [1.0]))
    fig.tight_layout()
    path = os.path.join(out_dir, f"{op}_speedup.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--results_dir", default=os.path.join(HERE, "results"))
  p.add_argument("--out_dir", default=None,
                 help="Where PNGs and summary.md go (default: results_dir).")
  args = p.parse_args(argv)
  out_dir = args.out_dir or args.results_dir
  os.makedirs(out_dir, exist_ok=True)
  rows, metas = load(args.results_dir)
  md = summary_md(rows, metas)
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(md)
  print(md)
  for path in plot(rows, out_dir):
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
