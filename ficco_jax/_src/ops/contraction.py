"""The weight gradient of both ops: a contraction with a gathered operand.

``dw`` of ``all_gather(x) @ w`` is ``all_gather(x)^T @ ct``, and ``dw`` of
``psum_scatter(h @ w)`` is ``h^T @ all_gather(ct)``. Where the gathered
operand is at hand (the all-gather's forward kept it, the reduce-scatter's
``dh`` gathered the cotangent), `contract_rows` is one dot. Where it is
not (the push all-gather, whose pieces stay in its windows),
`gathered_contraction` gathers it piece by piece (`gather.run`) and
accumulates each landed piece's contribution while the next is in flight.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import gather
from ficco_jax._src import matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src.matmul import Static


def contract_rows(a: jax.Array, g: jax.Array, st: Static,
                  out_dtype) -> jax.Array:
  """``a^T @ g`` over every axis but the last, both operands whole (one dot
  in ``out_dtype``; the accumulation inside it is the dot's own, f32 for
  16-bit operands on GPUs)."""
  lead = tuple(range(a.ndim - 1))
  return lax.dot_general(a, g, ((lead, lead), ((), ())),
                         precision=st.precision,
                         preferred_element_type=out_dtype)


def gathered_contraction(x0: jax.Array, g: jax.Array,
                         st: Static) -> jax.Array:
  """``all_gather(x0)^T @ g``, overlapped: ``x0`` gathered piecewise, each
  landed piece contracted with the rows of ``g`` it owns while the next is
  in flight.

  Contracts every axis but the last.

  Args:
    x0: the local shard, ``[m, *rest, Kx]``.
    g: full-size, ``[P * m, *rest, Kg]``.
    st: static config (its schedule picks dataflow and comm).

  Returns:
    ``[Kx, Kg]`` in at least float32 (the caller casts).
  """
  p, m = st.axis_size, x0.shape[0]
  acc_dtype = matmul.acc_dtype(jnp.promote_types(x0.dtype, g.dtype))
  contract = lambda a, b: contract_rows(a, b, st, acc_dtype)  # noqa: E731

  if not st.schedule.overlapped or p == 1:
    return contract(lax.all_gather(x0, st.axis_name, axis=0, tiled=True), g)

  rank = lax.axis_index(st.axis_name)
  schedule = st.schedule
  if schedule.compute == "pallas":
    # The in-place Pallas kernel writes rows of a product; an accumulated
    # [K, n] contraction has none, so XLA's dot does it.
    schedule = dataclasses.replace(schedule, compute="xla")
  gplan = plan_lib.gather_plan(schedule, axis_size=p, shard_rows=m)

  def consume(acc, data, blocks):
    for b in blocks:
      row = gather.owner_rank(b, rank, p) * m + b.owner_row
      other = lax.dynamic_slice_in_dim(g, row, b.rows, axis=0)
      acc = acc + contract(gather.block_rows(data, b), other)
    return acc

  acc = jnp.zeros((x0.shape[-1], g.shape[-1]), acc_dtype)
  st = dataclasses.replace(st, schedule=schedule)
  acc, pending = gather.run(x0, gplan, st, consume=consume, carry=acc)
  return gather.finish(acc, pending, st)
