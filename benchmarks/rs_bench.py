"""Benchmarks matmul_reduce_scatter: ficco schedules vs XLA dot + psum_scatter.

Case (M, K, N), global: h [M, K] sharded on columns (the contraction), w
[K, N] sharded on rows, over a 1-D mesh ``x`` of the first W devices. Per
device: h [M, K/W], w [K/W, N], out [M/W, N] =
psum_scatter(h @ w, 'x', scatter_dimension=0, tiled=True). For a model
(H, F): K = F, N = H (the row-parallel second matmul of an MLP).

Per case it times
  matmul  the local partial product alone ([M, K/W] @ [K/W, N]),
  comm    lax.psum_scatter alone, of an [M, N] bf16 partial (NCCL on GPUs),
  xla     psum_scatter(h @ w) in shard_map (T_seq),
  ficco   ficco_jax.matmul_reduce_scatter with each candidate schedule and
          with schedule=None,
and checks every result once against an f32 reference. JAX's Mosaic GPU ops
have no fused matmul + reduce-scatter, so there is no Mosaic peer here;
PyTorch's fused_matmul_reduce_scatter is in torch_async_tp.py.

  python benchmarks/rs_bench.py --models=llama3-70b --tokens=8192 \
      --axis_sizes=4 --schedules=quick --time_budget_s=150
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
common.define_flags(default_peers="")


def bench_case(run: common.Run, case: common.Case, w: int):
  from jax import lax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  m_glob, k_glob, n = case.m, case.k, case.n
  if m_glob % w or k_glob % w:
    run.data["skipped"].append({"name": case.name, "W": w, "reason":
                                f"M={m_glob} or K={k_glob} not divisible by W"})
    return None
  mesh = common.mesh_of(w)
  m, k = m_glob // w, k_glob // w
  tag = f"{case.name} W={w}"
  rec = {
      "name": case.name, "W": w, "M": m_glob, "K": k_glob, "N": n,
      "local": {"h": [m_glob, k], "w": [k, n], "out": [m, n]},
      "flops_per_device": 2 * m_glob * k * n,
      "bytes_out_per_device": (w - 1) * m * n * 2,
      "baselines": {}, "methods": [], "skipped_methods": [],
  }
  s = max(1, FLAGS.input_sets)
  hs = [common.random_array(mesh, (m_glob, k_glob), P(None, "x"), 10 * i + 1)
        for i in range(s)]
  ws = [common.random_array(mesh, (k_glob, n), P("x", None), 10 * i + 2)
        for i in range(s)]
  args = list(zip(hs, ws))
  in_specs = (P(None, "x"), P("x", None))
  out_spec = P("x", None)
  tk = dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)

  def scatter(y):
    return lax.psum_scatter(y, "x", scatter_dimension=0, tiled=True)

  # (a) The local partial product alone; each device's [M, N] partial is
  # returned as its block of a [W * M, N] array (no data movement). (a) and
  # (b) only set the ideal and are light: timed at once, not round-robin
  # (timing's docstring).
  def mm():
    f = common.jit_shard_map(lambda a, b: a @ b, mesh, in_specs, P("x", None))
    return timing.time_jax(f, args, **tk,
                           interleave=False)
  rec["baselines"]["matmul"] = common.timed(run, f"{tag} matmul", mm)

  # (b) The reduce-scatter alone, of one [M, N] partial per device.
  def rs():
    ys = [common.random_array(mesh, (w * m_glob, n), P("x", None), 10 * i + 3)
          for i in range(s)]
    f = common.jit_shard_map(scatter, mesh, P("x", None), P("x", None))
    return timing.time_jax(f, [(y,) for y in ys], **tk,
                           interleave=False)
  rec["baselines"]["comm"] = common.timed(run, f"{tag} reduce_scatter", rs)

  # (c) XLA: dot then psum_scatter, no overlap.
  xla_fn = common.jit_shard_map(lambda a, b: scatter(a @ b), mesh, in_specs,
                                out_spec)
  rec["baselines"]["xla"] = common.timed(
      run, f"{tag} xla", lambda: timing.time_jax(xla_fn, args, **tk))

  ref32 = xla_err = None
  if FLAGS.check:
    def ref_body(a, b):
      return scatter(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                             precision=lax.Precision.HIGHEST))
    try:
      ref32 = common.jit_shard_map(ref_body, mesh, in_specs,
                                   out_spec)(*args[0])
      xla_err = common.rel_err(xla_fn(*args[0]), ref32)
      rec["baselines"]["xla"]["rel_err"] = xla_err
    except Exception as e:  # pylint: disable=broad-except
      rec["check_error"] = common.short_error(e)
      ref32 = None

  measure = functools.partial(common.measure, args=args, ref32=ref32,
                              xla_err=xla_err, tk=tk)
  # (d) ficco, every candidate schedule.
  common.run_ficco(run, rec, tag, "matmul_reduce_scatter", mesh, in_specs,
                   out_spec, measure,
                   resolve_kw=dict(x_shape=(m_glob, k), w_shape=(k, n),
                                   axis_size=w))
  if "mosaic" in FLAGS.peers:
    rec["methods"].append({"method": "mosaic", "label": "*", "skipped":
                           "JAX Mosaic GPU has no fused matmul+reduce-scatter"})
  if "torch" in FLAGS.peers:
    rec["methods"].append({
        "method": "torch", "label": "*",
        "skipped": "measured by torch_async_tp.py under torchrun; plot.py"
                   " merges it"})
  return rec


def main(argv):
  del argv
  run = common.Run(
      "rs", "matmul_reduce_scatter: h [M, K] cols-sharded @ w [K, N]"
      " rows-sharded -> out [M, N] rows-sharded",
      common.md_row, common.MD_HEADER.format(comm="reduce_scatter"))
  common.run_all(run, bench_case, "rs")


if __name__ == "__main__":
  app.run(main)
