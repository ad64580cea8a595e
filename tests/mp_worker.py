"""A process of a multi-process test, started by ficco_jax.launch.

  mode "ops":  both ops with comm="xla" over an axis that spans every
               process, checked against a float64 reference.
  mode "dma":  comm="dma" on such an axis must be refused, naming comm='xla'.
  mode "die":  process 1 exits at once; the others block in a collective
               (the launcher must stop them).
"""

import os
import sys

from ficco_jax import launch

launch.initialize_from_env()

import functools  # pylint: disable=g-import-not-at-top,g-bad-import-order

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule


def _global(mesh, spec, a):
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                      lambda idx: a[idx])


def _check(out, ref):
  for shard in out.addressable_shards:
    got = np.asarray(shard.data, np.float64)
    want = ref[shard.index]
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, err


def _run(op, mesh, a, w, a_spec, w_spec, out_spec, schedule):
  f = jax.jit(jax.shard_map(
      functools.partial(op, axis_name="x", schedule=schedule), mesh=mesh,
      in_specs=(a_spec, w_spec), out_specs=out_spec))
  return f(_global(mesh, a_spec, a), _global(mesh, w_spec, w))


def main(mode: str) -> int:
  p = jax.device_count()
  mesh = jax.make_mesh((p,), ("x",))
  rng = np.random.default_rng(0)  # Same data in every process.
  x = rng.standard_normal((6 * p, 10)).astype(np.float32)
  w = rng.standard_normal((10, 3 * p)).astype(np.float32)
  h = rng.standard_normal((6 * p, 4 * p)).astype(np.float32)
  w2 = rng.standard_normal((4 * p, 5)).astype(np.float32)
  if mode == "ops":
    for schedule in (Schedule(dataflow="direct", num_chunks=2),
                     Schedule(dataflow="ring", num_chunks=3)):
      out = _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
                 P(None, "x"), schedule)
      _check(out, x.astype(np.float64) @ w)
      out = _run(ficco_jax.matmul_reduce_scatter, mesh, h, w2, P(None, "x"),
                 P("x"), P("x"), schedule)
      _check(out, h.astype(np.float64) @ w2)
    return 0
  if mode == "dma":
    try:
      _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
           P(None, "x"), Schedule(dataflow="ring", comm="dma"))
    except ValueError as e:
      return 0 if "use comm='xla'" in str(e) else 3
    return 4  # comm="dma" must not run across processes.
  if mode == "die":
    if jax.process_index() == 1:
      # Die like a crashed process: no exit handlers, so no distributed
      # shutdown barrier that would hold this process until the peers leave.
      os._exit(7)
    # Waits for process 1 forever: the launcher has to stop it.
    _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
         P(None, "x"), Schedule(dataflow="none")).block_until_ready()
    return 0
  raise ValueError(f"unknown {mode=}")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
