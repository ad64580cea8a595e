"""One-GPU probe: does TMA multicast over a 2-CTA cluster close the chunk
kernel's gap to cuBLAS?

Session 22 call A: on the per-device sizes of issue 6's reduce-scatter
shapes, ficco's Hopper kernel (128x256 CTA tile, no cluster) trails XLA's
dot by 2-13% (most at K = 2048), and neither the tile order nor
delay_release (tried then, since removed) closes it. jax's own Hopper matmul
(jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu) has the same
structure plus ``cluster_dimension``: two CTAs of a cluster share one
operand tile through TMA multicast, cutting L2 traffic per flop. This times
that kernel with and without a cluster against XLA's dot and against
ficco's kernel, interleaved per shape, to decide whether ficco's kernel
should take clusters. Writes --out_dir/cluster_probe_<tag>.json.

  python3 benchmarks/cluster_probe.py --out_dir=/tmp/r
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import timing  # noqa: E402  pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
# Per-device (W = 4) reduce-scatter chunks: mc x K x n.
flags.DEFINE_list("shapes", ["16384x2048x8192", "8192x12288x12288",
                             "8192x7168x8192", "4096x3584x4096",
                             "4096x2048x8192"], "mc x K x n.")
flags.DEFINE_list("variants", ["xla", "ficco", "jax", "jax@w8", "jax@cm",
                               "jax@cm+w8", "jax@cn", "jax@cn+w8"],
                  "xla (jnp.dot), ficco (its kernel, own config), jax "
                  "(hopper_matmul_mgpu at ficco's 128x256 tile); @w8 grid"
                  " tile width 8, @cm / @cn a 2-CTA cluster along m / n.")
flags.DEFINE_integer("rounds", 7, "Timed rounds.")
flags.DEFINE_integer("iters", 20, "Calls per round (raised by min_round_ms).")
flags.DEFINE_float("min_round_ms", 25.0, "Shortest round.")
flags.DEFINE_string("out_dir", "/tmp", "Where results go.")
flags.DEFINE_string("tag", "h200", "Result file suffix.")


def _build(variant):
  import jax
  import jax.numpy as jnp
  from ficco_jax._src.pallas import chunk_matmul as cm
  if variant == "xla":
    return jax.jit(jnp.dot)
  if variant == "ficco":
    return jax.jit(lambda x, w: cm.chunk_matmul_pieces(x, [0], x.shape[0], w))
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  _, _, spec = variant.partition("@")
  opts = set(spec.split("+")) if spec else set()
  d = hm.MatmulDimension
  cluster = d.M if "cm" in opts else d.N if "cn" in opts else None
  config = hm.TuningConfig(
      tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4,
      epi_tile_m=64, epi_tile_n=64, grid_minor_dim=d.N,
      grid_tile_width=8 if "w8" in opts else 1, wg_dimension=d.M,
      cluster_dimension=cluster)
  import inspect
  if "c" in inspect.signature(hm.matmul).parameters:  # jax 0.10: a C addend.
    return jax.jit(lambda x, w: hm.matmul(x, w, None, config))
  return jax.jit(lambda x, w: hm.matmul(x, w, config=config))


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  timing.set_min_round_ms(FLAGS.min_round_ms)
  out = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "jax": jax.__version__,
                  "device": jax.devices()[0].device_kind, "argv": sys.argv,
                  "timing": timing.settings()}, "cases": []}
  for shape in FLAGS.shapes:
    mc, k, n = (int(v) for v in shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 4)
    xs = [jax.random.normal(keys[i], (mc, k), jnp.bfloat16) for i in range(2)]
    ws = [jax.random.normal(keys[2 + i], (k, n), jnp.bfloat16) / k ** 0.5
          for i in range(2)]
    ref = np.asarray(jnp.dot(xs[0], ws[0], preferred_element_type=jnp.float32))
    rec = {"shape": shape, "methods": {}}
    with timing.interleaved():
      for v in FLAGS.variants:
        try:
          fn = _build(v)
          got = np.asarray(fn(xs[0], ws[0]), np.float32)
          err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
          t_rec = timing.time_jax(fn, list(zip(xs, ws)), rounds=FLAGS.rounds,
                                  iters=FLAGS.iters)
          t_rec["rel_err"] = err
          rec["methods"][v] = t_rec
        except Exception as e:  # pylint: disable=broad-except
          rec["methods"][v] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    flop = 2 * mc * k * n
    for v, r in rec["methods"].items():
      if "median_ms" in r:
        r["tflops"] = flop / r["median_ms"] / 1e9
    print(shape, " ".join(
        f"{v}={r['median_ms']:.4f}({r['tflops']:.0f}TF,err={r['rel_err']:.4f})"
        if "median_ms" in r else f"{v}=ERR[{r['error'][:200]}]"
        for v, r in rec["methods"].items()), flush=True)
    out["cases"].append(rec)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, f"cluster_probe_{FLAGS.tag}.json"),
              "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
