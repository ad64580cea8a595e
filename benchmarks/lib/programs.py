"""The programs the ops suite compares, for both ops, through public APIs only.

all_gather_matmul ("ag"): global x [M, K] row-sharded, w [K, N] column-sharded
on a 1-D mesh ``x`` of W devices; per device x [M/W, K] @ w [K, N/W] ->
[M, N/W] = all_gather(x) @ w.

matmul_reduce_scatter ("rs"): global h [M, K] column-sharded, w [K, N]
row-sharded; per device h [M, K/W] @ w [K/W, N] -> [M/W, N] =
psum_scatter(h @ w).

Per op:

* ``xla``: XLA's collective and dot in ``shard_map`` (what users write);
* ``xla_overlap``: the same product written pjit style (global arrays,
  shardings only), compiled with the latency-hiding scheduler and the
  windowed-einsum flags (`OVERLAP_OPTIONS`), so the SPMD partitioner may
  emit its own overlapped (windowed) einsum: XLA at its best;
* ``ficco``: ``ficco_jax.<op>`` in ``shard_map`` with a schedule;
* the matmul alone and the collective alone (they set the ideal);
* an f32 reference (``Precision.HIGHEST``) for the correctness check.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from lib import cases as cases_lib
from lib import jax_util

# "XLA at its best": XLA's own collective-matmul overlap. Passed per program
# (Lowered.compile(compiler_options=...)), so the flags touch nothing else.
OVERLAP_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
    "xla_gpu_multi_streamed_windowed_einsum": True,
}
# Left out, and the program built again, when XLA's result with every
# option is wrong (the multi-streamed windowed all-gather einsum of jax
# 0.11.2 on four GPUs): the baseline stays XLA at its best that is right.
OVERLAP_FALLBACK_WITHOUT = ("xla_gpu_multi_streamed_windowed_einsum",)


def compile_overlapped(lowered, without=()) -> tuple[object, dict]:
  """``lowered`` compiled with `OVERLAP_OPTIONS` (less ``without``).

  Options this XLA does not know are dropped one by one and named in the
  returned notes (``options_rejected``), so one renamed flag does not lose
  the whole program.

  Returns:
    (the compiled executable, notes: options used and rejected).
  """
  options = {k: v for k, v in OVERLAP_OPTIONS.items() if k not in without}
  rejected = {}
  while True:
    try:
      return lowered.compile(compiler_options=options), {
          "compiler_options": options, "options_rejected": rejected}
    except Exception as e:  # pylint: disable=broad-except
      bad = re.search(r"No such compile option: '([^']+)'", str(e))
      if not bad or bad.group(1) not in options:
        raise
      rejected[bad.group(1)] = str(e)[:300]
      del options[bad.group(1)]
      if not options:
        raise


@dataclasses.dataclass(frozen=True)
class Op:
  """One op's layouts and programs (see the module docstring)."""

  key: str  # "ag" or "rs"

  @property
  def name(self) -> str:
    return cases_lib.OPS[self.key]

  @property
  def specs(self):
    """(in_specs, out_spec) on the mesh axis "x"."""
    from jax.sharding import PartitionSpec as P
    if self.key == "ag":
      return (P("x", None), P(None, "x")), P(None, "x")
    return (P(None, "x"), P("x", None)), P("x", None)

  def inputs(self, mesh, case, sets: int, seed: int = 0) -> list[tuple]:
    """``sets`` random (first operand, w) pairs, global and sharded."""
    (a_spec, w_spec), _ = self.specs
    return [(jax_util.random_array(mesh, (case.m, case.k), a_spec,
                                   seed + 10 * i + 1),
             jax_util.random_array(mesh, (case.k, case.n), w_spec,
                                   seed + 10 * i + 2))
            for i in range(sets)]

  def xla_body(self):
    from jax import lax
    if self.key == "ag":
      return lambda a, b: lax.all_gather(a, "x", axis=0, tiled=True) @ b
    return lambda a, b: lax.psum_scatter(a @ b, "x", scatter_dimension=0,
                                         tiled=True)

  def reference_body(self):
    """The op in f32 at the highest precision (the correctness reference)."""
    from jax import lax
    import jax.numpy as jnp

    def dot(a, b):
      return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    if self.key == "ag":
      return lambda a, b: dot(lax.all_gather(a, "x", axis=0, tiled=True), b)
    return lambda a, b: lax.psum_scatter(dot(a, b), "x", scatter_dimension=0,
                                         tiled=True)

  def ficco_body(self, schedule):
    """``ficco_jax.<op>`` with ``schedule`` (None: the library's choice)."""
    import ficco_jax
    return functools.partial(getattr(ficco_jax, self.name), axis_name="x",
                             schedule=schedule)

  def shard_mapped(self, mesh, body, check_vma=True):
    in_specs, out_spec = self.specs
    return jax_util.jit_shard_map(body, mesh, in_specs, out_spec, check_vma)

  def matmul_alone(self, mesh, case, args, seed: int = 0):
    """(fn, arg sets) of the local product with no communication."""
    from jax.sharding import PartitionSpec as P
    in_specs, out_spec = self.specs
    if self.key == "ag":
      # On an x every device already holds in full.
      sets = [(jax_util.random_array(mesh, (case.m, case.k), P(None, None),
                                     seed + 10 * i + 3), w)
              for i, (_, w) in enumerate(args)]
      return jax_util.jit_shard_map(lambda a, b: a @ b, mesh,
                                    (P(None, None), in_specs[1]),
                                    out_spec), sets
    # Each device's [M, N] partial returned as its block of [W * M, N].
    return jax_util.jit_shard_map(lambda a, b: a @ b, mesh, in_specs,
                                  P("x", None)), args

  def comm_alone(self, mesh, case, args, seed: int = 0):
    """(fn, arg sets) of XLA's collective alone (NCCL on GPUs)."""
    from jax import lax
    from jax.sharding import PartitionSpec as P
    if self.key == "ag":
      fn = jax_util.jit_shard_map(
          lambda a: lax.all_gather(a, "x", axis=0, tiled=True), mesh,
          P("x", None), P("x", None))
      return fn, [(a,) for a, _ in args]
    w = mesh.shape["x"]
    ys = [(jax_util.random_array(mesh, (w * case.m, case.n), P("x", None),
                                 seed + 10 * i + 4),)
          for i in range(len(args))]
    fn = jax_util.jit_shard_map(
        lambda y: lax.psum_scatter(y, "x", scatter_dimension=0, tiled=True),
        mesh, P("x", None), P("x", None))
    return fn, ys

  def xla_overlap(self, mesh, args, without=()) -> tuple[object, dict]:
    """XLA's product compiled pjit style with `OVERLAP_OPTIONS`
    (`compile_overlapped`).

    Args:
      mesh: the mesh of the axis "x".
      args: the argument sets; the first is used to lower.
      without: options of `OVERLAP_OPTIONS` to leave out.

    Returns:
      (the compiled executable, notes: options used and rejected).
    """
    import jax
    from jax.sharding import NamedSharding
    (a_spec, w_spec), out_spec = self.specs
    f = jax.jit(lambda a, b: a @ b,
                in_shardings=(NamedSharding(mesh, a_spec),
                              NamedSharding(mesh, w_spec)),
                out_shardings=NamedSharding(mesh, out_spec))
    return compile_overlapped(f.lower(*args[0]), without)


OPS = {key: Op(key) for key in cases_lib.OPS}
