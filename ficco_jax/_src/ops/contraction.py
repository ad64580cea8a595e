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


def gathered_contraction(a0: jax.Array, g0: jax.Array, st: Static, *,
                         gather_operand: str) -> jax.Array:
  """``all_gather(a0)^T @ g0`` or ``a0^T @ all_gather(g0)``, overlapped.

  Contracts every axis but the last. Exactly one operand is sharded along
  the first axis and gathered piecewise; the other is full-size and sliced
  at the rows each landed piece owns.

  Args:
    a0: ``[rows_a, *rest, Ka]``.
    g0: ``[rows_g, *rest, Kg]``.
    st: static config (its schedule picks dataflow and comm).
    gather_operand: ``"a"`` or ``"g"``: which operand is the local shard.

  Returns:
    ``[Ka, Kg]`` in at least float32 (the caller casts).
  """
  p = st.axis_size
  shard, full = (a0, g0) if gather_operand == "a" else (g0, a0)
  m = shard.shape[0]
  lead = tuple(range(a0.ndim - 1))
  acc_dtype = matmul.acc_dtype(jnp.promote_types(a0.dtype, g0.dtype))

  def contract(shard_piece, full_piece):
    a, g = ((shard_piece, full_piece) if gather_operand == "a"
            else (full_piece, shard_piece))
    return lax.dot_general(a, g, ((lead, lead), ((), ())),
                           precision=st.precision,
                           preferred_element_type=acc_dtype)

  if not st.schedule.overlapped or p == 1:
    gathered = lax.all_gather(shard, st.axis_name, axis=0, tiled=True)
    return contract(gathered, full)

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
      piece = gather.block_rows(data, b)
      other = lax.dynamic_slice_in_dim(full, row, b.rows, axis=0)
      acc = acc + contract(piece, other)
    return acc

  acc = jnp.zeros((a0.shape[-1], g0.shape[-1]), acc_dtype)
  st = dataclasses.replace(st, schedule=schedule)
  acc, pending = gather.run(shard, gplan, st, consume=consume, carry=acc)
  return gather.finish(acc, pending, st)
