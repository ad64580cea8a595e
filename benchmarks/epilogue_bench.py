"""The reduce-scatter's own rows on one GPU: the kernel's epilogue sum
against a separate pass.

For each case, the own rows ``[m, K] @ [K, n]`` of a 4-way reduce-scatter
and the ``P - 1 = 3`` partials pulled from the peers:

* ``kernel``: ficco's Hopper kernel alone (no sum);
* ``kernel+sum``: the kernel, then XLA's fused pass adding the three
  partials in f32 (what `rs_matmul` runs without ``reduce_in_epilogue``);
* ``epilogue``: the kernel adding the partials in its epilogue
  (``reduce_in_epilogue``), in one launch or in ``c`` chunk launches that
  write one result in place (``epilogue/cN``).

Each timed with `timing.time_jax` (interleaved, median over rounds); the
ratio ``kernel+sum / epilogue`` is what the fused sum saves. Writes JSON
and a markdown table.

  python3 benchmarks/epilogue_bench.py --out=/tmp/epi.json
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import timing  # pylint: disable=g-import-not-at-top

from ficco_jax._src.pallas import chunk_matmul as cm  # pylint: disable=g-import-not-at-top

# (name, own rows m, K per device, n): the ten reduce-scatter shapes at P=4.
_CASES = (
    ("llama3-8b/M8192", 2048, 3584, 4096),
    ("llama3-70b/M4096", 1024, 7168, 8192),
    ("llama3-70b/M8192", 2048, 7168, 8192),
    ("gpt3-175b/M4096", 1024, 12288, 12288),
    ("square/4096", 1024, 2048, 8192),
    ("square/16384", 4096, 2048, 8192),
)

flags.DEFINE_string("out", "/tmp/epilogue_bench.json", "JSON output path.")
flags.DEFINE_integer("rounds", 7, "Timed rounds per candidate.")
flags.DEFINE_integer("iters", 20, "Calls per round (raised for short ops).")
flags.DEFINE_list("chunks", ["1", "2"], "Chunk counts of the epilogue form.")
flags.DEFINE_bool("smoke", False, "Tiny shapes (CPU check of the script).")
FLAGS = flags.FLAGS


def _own(x, w, addends, chunks):
  m = x.shape[0]
  mc = m // chunks
  out = None
  for j in range(chunks):
    kw = (dict(out_rows=[j * mc], fresh_rows=m) if out is None
          else dict(out=out, out_rows=[j * mc]))
    out = cm.chunk_matmul_pieces(
        x, [j * mc], mc, w, preferred_element_type=jnp.bfloat16,
        addends=addends, addend_rows=[j * mc] * len(addends), **kw)
  return out


def main(argv):
  del argv
  timing.set_min_round_ms(25)
  dev = jax.devices()[0]
  rows = []
  cases = (("smoke", 64, 32, 48),) if FLAGS.smoke else _CASES
  for name, m, k, n in cases:
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 0.05
    parts = [jax.random.normal(kk, (m, n), jnp.bfloat16) for kk in keys[2:]]
    args = [(x, w, *parts)]

    kernel = jax.jit(lambda x, w, *p: cm.chunk_matmul_pieces(
        x, [0], x.shape[0], w, preferred_element_type=jnp.bfloat16))

    def _sum(x, w, *p):
      acc = cm.chunk_matmul_pieces(x, [0], x.shape[0], w,
                                   preferred_element_type=jnp.bfloat16)
      acc = acc.astype(jnp.float32)
      for q in p:
        acc = acc + q.astype(jnp.float32)
      return acc.astype(jnp.bfloat16)

    progs = {"kernel": kernel, "kernel+sum": jax.jit(_sum)}
    for c in map(int, FLAGS.chunks):
      progs[f"epilogue/c{c}"] = jax.jit(
          lambda x, w, *p, c=c: _own(x, w, list(p), c))
    ref = progs["kernel+sum"](*args[0]).astype(jnp.float32)
    errs = {}
    for label, fn in progs.items():
      if label.startswith("epilogue"):
        got = fn(*args[0]).astype(jnp.float32)
        errs[label] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    res = {}
    with timing.interleaved():
      for label, fn in progs.items():
        res[label] = timing.time_jax(fn, args, rounds=FLAGS.rounds,
                                     iters=FLAGS.iters)
    row = {"case": name, "m": m, "k": k, "n": n,
           "ms": {l: r["median_ms"] for l, r in res.items()},
           "min_ms": {l: r["min_ms"] for l, r in res.items()},
           "rel_err_vs_sum": errs}
    rows.append(row)
    print(json.dumps(row), flush=True)
  report = {"device": dev.device_kind, "jax": jax.__version__,
            "command": " ".join(sys.argv), "timing": timing.settings(),
            "cases": rows}
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=1)
  labels = list(rows[0]["ms"]) if rows else []
  md = [f"# Own rows with the pulled partials: {dev.device_kind},"
        f" jax {jax.__version__}", "", f"`{' '.join(sys.argv)}`", "",
        "Median ms per call; last column: kernel+sum / best epilogue.", "",
        "| case | m x K x n | " + " | ".join(labels) + " | saved |",
        "|---|---|" + "---|" * (len(labels) + 1)]
  for r in rows:
    best = min(v for l, v in r["ms"].items() if l.startswith("epilogue"))
    md.append(f"| {r['case']} | {r['m']}x{r['k']}x{r['n']} | "
              + " | ".join(f"{r['ms'][l]:.3f}" for l in labels)
              + f" | {r['ms']['kernel+sum'] / best:.3f}x |")
  with open(FLAGS.out.rsplit(".", 1)[0] + ".md", "w") as f:
    f.write("\n".join(md) + "\n")
  print("\n".join(md))


if __name__ == "__main__":
  app.run(main)
