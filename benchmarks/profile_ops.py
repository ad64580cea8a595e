"""Profiles ficco ops and XLA's baselines; prints where device time went.

Each spec is ``op:MxKxN:schedule`` (global sizes as in ag_bench.py /
rs_bench.py; ``op`` is ``ag`` or ``rs``; ``schedule`` is a label such as
``direct/c1/dma`` or ``xla`` for XLA's collective + dot). Per spec: compile,
warm up, trace ``--calls`` back-to-back calls with the JAX profiler, and
summarize the trace with profile_summary.py (streams, compute-stream gaps,
copy overlap, one call's timeline). Summaries go to stdout and to
``<out_dir>/profile_<n>.txt``.

  python benchmarks/profile_ops.py --specs=rs:4096x8192x8192:direct/c1/dma,rs:4096x8192x8192:xla
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import profile_summary  # noqa: E402


def build(op: str, m: int, k: int, n: int, label: str, w: int):
  """(jitted fn, args) for one spec on the first ``w`` devices."""
  import jax
  from jax import lax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  import ficco_jax

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:w]), ("x",))
  if op == "ag":
    specs, out = (P("x", None), P(None, "x")), P(None, "x")
    if label == "xla":
      body = lambda a, b: lax.all_gather(a, "x", tiled=True) @ b  # noqa: E731
    else:
      body = lambda a, b: ficco_jax.all_gather_matmul(  # noqa: E731
          a, b, axis_name="x", schedule=common.schedule_from_label(label))
  else:
    specs, out = (P(None, "x"), P("x", None)), P("x", None)
    if label == "xla":
      body = lambda a, b: lax.psum_scatter(  # noqa: E731
          a @ b, "x", scatter_dimension=0, tiled=True)
    else:
      body = lambda a, b: ficco_jax.matmul_reduce_scatter(  # noqa: E731
          a, b, axis_name="x", schedule=common.schedule_from_label(label))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out))
  keys = jax.random.split(jax.random.key(0), 4)
  args = []
  for i in range(2):
    a = jax.device_put(jax.random.normal(keys[2 * i], (m, k), jnp.bfloat16),
                       NamedSharding(mesh, specs[0]))
    b = jax.device_put(jax.random.normal(keys[2 * i + 1], (k, n), jnp.bfloat16),
                       NamedSharding(mesh, specs[1]))
    args.append((a, b))
  return fn, args


def profile(fn, args, calls: int, host_timeline: bool = False) -> str:
  import jax
  for i in range(5):
    out = fn(*args[i % len(args)])
  jax.block_until_ready(out)
  tmp = tempfile.mkdtemp(prefix="ficco_prof_")
  try:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    try:
      for i in range(calls):
        out = fn(*args[i % len(args)])
      jax.block_until_ready(out)
    finally:
      # A failed call must not leave the profiler on for the next spec.
      jax.profiler.stop_trace()
    return profile_summary.summarize(profile_summary.load(tmp), calls=calls,
                                     host_timeline=host_timeline)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--specs", required=True)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--axis_size", type=int, default=4)
  p.add_argument("--out_dir", default=".")
  p.add_argument("--host_timeline", action="store_true",
                 help="End each summary with the last call's host timeline.")
  a = p.parse_args()
  os.makedirs(a.out_dir, exist_ok=True)
  for i, spec in enumerate(a.specs.split(",")):
    op, shape, label = spec.split(":")
    m, k, n = (int(v) for v in shape.lower().split("x"))
    try:
      fn, args = build(op, m, k, n, label, a.axis_size)
      text = f"# {spec} ({a.calls} calls)\n" + profile(
          fn, args, a.calls, a.host_timeline)
    except Exception as e:  # pylint: disable=broad-except
      text = f"# {spec}: FAILED {type(e).__name__}: {str(e)[:800]}"
    print(text, flush=True)
    with open(os.path.join(a.out_dir, f"profile_{i}.txt"), "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
