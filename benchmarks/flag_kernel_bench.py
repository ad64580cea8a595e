"""One-GPU benchmark of the flagged reduce-scatter kernel's variants.

Session 16's flagged kernel (one launch for all of a device's pieces, a
piece flag bumped per tile) read 1-17% slower than four per-piece launches
on the GPU-bound shapes. This script times the kernel alone, per device of
an axis of --w devices, for issue 6's ten reduce-scatter shapes
(h [M, F/W] @ w [F/W, H], pieces of M/W rows), so the loss can be pinned to
its cause:

  xla          XLA dot of all rows (cuBLAS)
  pieces4      W launches of one piece each (piece c1's compute)
  one          one launch of all pieces, no flags, the config's own walk
  flag/<walk>/<bump>
               one flagged launch; walk "rows" (session 16: tile rows over
               all pieces) or "piece" (piece after piece, the config's walk
               inside); bump "tile" (every tile waits for its stores and
               bumps, session 16) or "piece_end" (a CTA's last tile of a
               piece waits and bumps once; chunk_matmul._mgpu_kernel).
               Session 17's call B ran an earlier "complete" (= "tile") and
               "boundary" (per-tile bumps, deferred a tile).

Any kernel variant may end in "@key=value+..." to change the tile config the
kernel would pick (chunk_matmul.default_config) in one field: w
(grid_tile_width), minor (grid_minor_dim), steps (max_concurrent_steps).
E.g. "one@w=8+minor=m" or "flag/piece/piece_end@w=8". Session 22's call A
also ran "dr" (delay_release, a config field tried then and removed).

The flags are zeroed by the jitted call itself (no copy protocol here), and
each flagged variant's flags are checked against flag_target once. Timing:
benchmarks/timing.py, interleaved per shape. Writes
--out_dir/flag_kernel_<tag>.{json,md}.

  PYTHONPATH=. python3 benchmarks/flag_kernel_bench.py --out_dir=/tmp/r
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import timing  # noqa: E402  pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_integer("w", 4, "Axis size the per-device shapes are cut for.")
flags.DEFINE_string("variants",
                    "xla,pieces4,one,flag/rows/tile,flag/piece/tile,"
                    "flag/piece/piece_end",
                    "Comma-separated variants (module docstring).")
flags.DEFINE_string("shapes", "", "Comma-separated case names (default: all).")
flags.DEFINE_string("base", "pieces4", "The variant the speeds are relative to.")
flags.DEFINE_integer("rounds", 7, "Timed rounds.")
flags.DEFINE_integer("iters", 20, "Calls per round (raised by min_round_ms).")
flags.DEFINE_float("min_round_ms", 25.0, "Shortest round.")
flags.DEFINE_string("out_dir", "/tmp", "Where results go.")
flags.DEFINE_string("tag", "h200", "Result file suffix.")

# Issue 6's ten reduce-scatter shapes, from shapes.json (as rs_bench.py's
# --models=llama3-8b,llama3-70b,qwen2-72b,gpt3-175b --tokens=4096,8192
# --square=true builds them): name -> (M, K = F or the square's K, N = H).
def _cases() -> dict[str, tuple[int, int, int]]:
  import common  # pylint: disable=g-import-not-at-top
  cases = common.build_cases(
      "rs", shapes_path=os.path.join(HERE, "shapes.json"),
      models=["llama3-8b", "llama3-70b", "qwen2-72b", "gpt3-175b"],
      tokens=["4096", "8192"], square=True, extra=[], tiny=False)
  return {c.name: (c.m, c.k, c.n) for c in cases}


_CONFIG_KEYS = {"w": ("grid_tile_width", int), "minor": ("grid_minor_dim", str),
                "steps": ("max_concurrent_steps", int)}


def _config(spec, h, w, mc, rows):
  """The config the kernel picks for mc rows in pieces of ``rows``, with the
  fields ``spec`` ("w=8+minor=m") names replaced; None for an empty spec."""
  import dataclasses
  from ficco_jax._src.pallas import chunk_matmul as cm
  if not spec:
    return None
  k, n = h.shape[1], w.shape[1]
  cfg = cm.default_config(mc, k, n, h.dtype, h.dtype)
  if rows % cfg.cta_tile_m:
    cfg = cm.default_config(rows, k, n, h.dtype, h.dtype)
  changes = {}
  for item in spec.split("+"):
    key, value = item.split("=")
    field, kind = _CONFIG_KEYS[key]
    changes[field] = kind(value)
  return dataclasses.replace(cfg, **changes)


def _build(variant, h, w, rows, pieces, padded):
  import jax
  import jax.numpy as jnp
  from ficco_jax._src.pallas import chunk_matmul as cm

  variant, _, spec = variant.partition("@")
  x_rows = [i * rows for i in range(pieces)]
  mc = rows if variant == "pieces4" else rows * pieces
  kw = dict(x_zero_padded_k=padded, config=_config(spec, h, w, mc, rows))
  if variant == "xla":
    k = w.shape[0]
    return jax.jit(lambda h, w: jnp.dot(h[:, :k], w)), None
  if variant == "pieces4":
    return jax.jit(lambda h, w: [
        cm.chunk_matmul_pieces(h, [r], rows, w, **kw) for r in x_rows]), None
  if variant == "one":
    return jax.jit(lambda h, w: cm.chunk_matmul_pieces(
        h, x_rows, rows, w, **kw)), None
  _, walk, bump = variant.split("/")

  def f(h, w):
    out, fl, target = cm.chunk_matmul_pieces(
        h, x_rows, rows, w, _flags=jnp.zeros((pieces,), jnp.int32),
        _flag_variant=(walk, bump), **kw)
    f.target = target
    return out, fl
  return jax.jit(f), f


def bench_case(name, shape, variants):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from ficco_jax._src.pallas import chunk_matmul as cm

  m, k_full, n = shape
  k = k_full // FLAGS.w
  rows = m // FLAGS.w
  keys = jax.random.split(jax.random.key(0), 4)
  hs = [jax.random.normal(keys[i], (m, k), jnp.bfloat16) for i in range(2)]
  ws = [jax.random.normal(keys[2 + i], (k, n), jnp.bfloat16) / k ** 0.5
        for i in range(2)]
  padded = k != cm.padded_k(k)
  if padded:  # As the reduce-scatter does (qwen2-72b's 7392 columns).
    hs = [cm.pad_k(h) for h in hs]
  ref = np.asarray(jnp.dot(hs[0][:, :k], ws[0],
                           preferred_element_type=jnp.float32))
  rec = {"name": name, "local": {"h": [m, k], "w": [k, n], "rows": rows},
         "methods": {}}
  arg_sets = [(hs[i], ws[i]) for i in range(2)]
  with timing.interleaved():
    for v in variants:
      try:
        fn, holder = _build(v, hs[0], ws[0], rows, FLAGS.w, padded)
        out = fn(*arg_sets[0])
        got = out[0] if holder is not None else out
        got = (jnp.concatenate(got, 0) if isinstance(got, list) else got)
        got = np.asarray(got, np.float32)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        m_rec = {"rel_err": err}
        if holder is not None:
          m_rec["flags"] = [int(t) for t in np.asarray(out[1])]
          m_rec["flag_target"] = int(holder.target)
          m_rec["flags_ok"] = all(t == holder.target
                                  for t in m_rec["flags"])
        # Interleaved: time_jax's dict is filled when the block exits, so
        # it is the record (not a copy of it).
        t_rec = timing.time_jax(fn, arg_sets, rounds=FLAGS.rounds,
                                iters=FLAGS.iters)
        t_rec.update(m_rec)
        rec["methods"][v] = t_rec
      except Exception as e:  # pylint: disable=broad-except
        rec["methods"][v] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        print(f"  {v}: {rec['methods'][v]['error'][:300]}", flush=True)
  base = rec["methods"].get(FLAGS.base, {}).get("median_ms")
  for v, m_rec in rec["methods"].items():
    if base and m_rec.get("median_ms"):
      m_rec["vs_base"] = base / m_rec["median_ms"]
  print(name, " ".join(
      f"{v}={r.get('median_ms', float('nan')):.4f}"
      + ("" if r.get("flags_ok", True) else "(FLAGS WRONG)")
      for v, r in rec["methods"].items()), flush=True)
  return rec


def _save(out, variants) -> list[str]:
  """Writes --out_dir/flag_kernel_<tag>.{json,md}; returns the md table."""
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  stem = os.path.join(FLAGS.out_dir, f"flag_kernel_{FLAGS.tag}")
  with open(stem + ".json", "w") as f:
    json.dump(out, f, indent=1)
  lines = ["| case | " + " | ".join(variants) + " |",
           "|---" * (len(variants) + 1) + "|"]
  for c in out["cases"]:
    cells = []
    for v in variants:
      r = c["methods"].get(v, {})
      if "median_ms" not in r:
        cells.append("error")
        continue
      cell = f"{r['median_ms']:.4f}"
      if "vs_base" in r:
        cell += f" ({r['vs_base']:.3f}x)"
      if not r.get("flags_ok", True):
        cell += " FLAGS WRONG"
      cells.append(cell)
    lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
  with open(stem + ".md", "w") as f:
    f.write(f"Median ms per call (speed vs {FLAGS.base}), "
            f"{out['meta']['device']}, jax {out['meta']['jax']}\n\n"
            + "\n".join(lines) + "\n")
  return lines


def main(argv):
  del argv
  import jax
  timing.set_min_round_ms(FLAGS.min_round_ms)
  variants = [v for v in FLAGS.variants.split(",") if v]
  cases = _cases()
  names = [s for s in FLAGS.shapes.split(",") if s] or list(cases)
  out = {"meta": {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "jax": jax.__version__, "device": jax.devices()[0].device_kind,
      "host": platform.node(), "argv": sys.argv, "w": FLAGS.w,
      "base": FLAGS.base,
      "timing": timing.settings()}, "cases": []}
  lines: list[str] = []
  for name in names:
    out["cases"].append(bench_case(name, cases[name], variants))
    lines = _save(out, variants)  # After each case: a timeout keeps them.
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
