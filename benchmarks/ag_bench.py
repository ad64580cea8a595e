"""Benchmarks all_gather_matmul: ficco schedules vs XLA, NCCL and Mosaic GPU.

Case (M, K, N), global: x [M, K] sharded on rows, w [K, N] sharded on
columns, over a 1-D mesh ``x`` of the first W devices. Per device: x [M/W, K],
w [K, N/W], out [M, N/W] = all_gather(x) @ w.

Per case it times
  matmul  the local product alone, on an already gathered x ([M, K] @ [K, N/W]),
  comm    lax.all_gather alone (NCCL on GPUs),
  xla     lax.all_gather(x, 'x', tiled=True) @ w in shard_map (T_seq),
  ficco   ficco_jax.all_gather_matmul with each candidate schedule and with
          schedule=None (the library's own choice),
  mosaic  jax.experimental.pallas.ops.gpu.collective_matmul_mgpu
          .all_gather_lhs_matmul over a small tile search (Hopper GPUs, whole
          mesh, bf16),
and checks every overlapped result once against an f32 reference.

  python benchmarks/ag_bench.py --models=llama3-70b --tokens=8192 \
      --axis_sizes=4 --schedules=quick --time_budget_s=200
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
common.define_flags(default_peers="mosaic,torch")


def _mosaic_kernel(cfg: str):
  """all_gather_lhs_matmul with one tile config, for either signature."""
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
  tm, tn, tk, steps = (int(v) for v in cfg.lower().split("x"))
  params = inspect.signature(cm.all_gather_lhs_matmul).parameters
  if "config" in params:  # jax >= 0.8: a hopper_matmul_mgpu.TuningConfig.
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    config = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk,
                             max_concurrent_steps=steps)
    kw = {"config": config}
  else:  # Older: block sizes as keywords.
    kw = {"block_m": tm, "block_n": tn, "block_k": tk,
          "max_concurrent_steps": steps}
    if "sm_n_tile" in params:
      kw["sm_n_tile"] = 1
  return functools.partial(cm.all_gather_lhs_matmul, axis_name="x",
                           dtype=jnp.bfloat16, **kw)


def bench_case(run: common.Run, case: common.Case, w: int):
  import jax
  from jax import lax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  m_glob, k, n_glob = case.m, case.k, case.n
  if m_glob % w or n_glob % w:
    run.data["skipped"].append({"name": case.name, "W": w, "reason":
                                f"M={m_glob} or N={n_glob} not divisible by W"})
    return None
  mesh = common.mesh_of(w)
  m, n = m_glob // w, n_glob // w
  tag = f"{case.name} W={w}"
  rec = {
      "name": case.name, "W": w, "M": m_glob, "K": k, "N": n_glob,
      "local": {"x": [m, k], "w": [k, n], "out": [m_glob, n]},
      "flops_per_device": 2 * m_glob * k * n,
      "bytes_in_per_device": (w - 1) * m * k * 2,
      "baselines": {}, "methods": [], "skipped_methods": [],
  }
  s = max(1, FLAGS.input_sets)
  xs = [common.random_array(mesh, (m_glob, k), P("x", None), 10 * i + 1)
        for i in range(s)]
  ws = [common.random_array(mesh, (k, n_glob), P(None, "x"), 10 * i + 2)
        for i in range(s)]
  args = list(zip(xs, ws))
  in_specs = (P("x", None), P(None, "x"))
  out_spec = P(None, "x")
  tk = dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)

  # (a) The matmul alone, on an x every device already holds in full. (a)
  # and (b) only set the ideal: timed at once, not round-robin (timing's
  # docstring).
  def mm():
    xg = [common.random_array(mesh, (m_glob, k), P(None, None), 10 * i + 3)
          for i in range(s)]
    f = common.jit_shard_map(lambda a, b: a @ b, mesh,
                             (P(None, None), P(None, "x")), out_spec)
    return timing.time_jax(f, list(zip(xg, ws)), **tk,
                           interleave=False)
  rec["baselines"]["matmul"] = common.timed(run, f"{tag} matmul", mm)

  # (b) The all-gather alone.
  def ag():
    f = common.jit_shard_map(
        lambda a: lax.all_gather(a, "x", axis=0, tiled=True),
        mesh, P("x", None), P("x", None))
    return timing.time_jax(f, [(x,) for x in xs], **tk,
                           interleave=False)
  rec["baselines"]["comm"] = common.timed(run, f"{tag} all_gather", ag)

  # (c) XLA: all-gather then dot, no overlap (what users write today).
  xla_fn = common.jit_shard_map(
      lambda a, b: lax.all_gather(a, "x", axis=0, tiled=True) @ b,
      mesh, in_specs, out_spec)
  rec["baselines"]["xla"] = common.timed(
      run, f"{tag} xla", lambda: timing.time_jax(xla_fn, args, **tk))

  ref32 = xla_err = None
  if FLAGS.check:
    def ref_body(a, b):
      a = lax.all_gather(a.astype(jnp.float32), "x", axis=0, tiled=True)
      return jnp.dot(a, b.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
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
  common.run_ficco(run, rec, tag, "all_gather_matmul", mesh, in_specs,
                   out_spec, measure,
                   resolve_kw=dict(x_shape=(m, k), w_shape=(k, n), axis_size=w))

  # (e) Mosaic GPU collective matmul.
  if "mosaic" in FLAGS.peers:
    reason = None
    if jax.devices()[0].platform != "gpu":
      reason = "needs a Hopper GPU (platform is %s)" % jax.devices()[0].platform
    elif w != jax.device_count():
      reason = (f"whole mesh only: the kernel requires axis size =="
                f" jax.device_count() ({w} != {jax.device_count()})")
    if reason:
      rec["methods"].append({"method": "mosaic", "label": "*",
                             "skipped": reason})
    else:
      for cfg in FLAGS.mosaic_configs:
        if run.over_budget():
          rec["skipped_methods"].append(f"mosaic {cfg}: time budget")
          continue

        def build(check_vma, cfg=cfg):
          del check_vma  # The kernel needs check_vma=False.
          return common.jit_shard_map(_mosaic_kernel(cfg), mesh, in_specs,
                                      out_spec, check_vma=False)
        res = common.timed(run, f"{tag} mosaic {cfg}",
                           lambda build=build: measure(build))
        # In place: interleaved timing fills this very dict later.
        res.update({"method": "mosaic", "label": cfg})
        rec["methods"].append(res)
  if "torch" in FLAGS.peers:
    rec["methods"].append({
        "method": "torch", "label": "*",
        "skipped": "measured by torch_async_tp.py under torchrun; plot.py"
                   " merges it"})
  return rec


def main(argv):
  del argv
  run = common.Run(
      "ag", "all_gather_matmul: x [M, K] rows-sharded @ w [K, N] cols-sharded",
      common.md_row, common.MD_HEADER.format(comm="all_gather"))
  common.run_all(run, bench_case, "ag")


if __name__ == "__main__":
  app.run(main)
