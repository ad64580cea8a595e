"""all_gather(x) @ w, and the gathered contraction of the backward pass.

Shapes follow the public op after the gathered axis is moved first:
``x0 [m, *rest, K]`` (the local shard), ``w [K, n]``, result
``[P * m, *rest, n]`` in rank order along the first axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import gather
from ficco_jax._src import plan as plan_lib
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import vma


@dataclasses.dataclass(frozen=True, kw_only=True)
class Static:
  """Everything about one call that is not an array (hashable)."""

  axis_name: str
  axis_size: int
  schedule: schedule_lib.Schedule
  precision: Any
  preferred_element_type: Any
  op_name: str
  timeout_s: float


def _dot(a, w, st: Static):
  return lax.dot_general(a, w, (((a.ndim - 1,), (0,)), ((), ())),
                         precision=st.precision,
                         preferred_element_type=st.preferred_element_type)


def dot_dtype(a, w, st: Static):
  """The result dtype of ``a @ w`` under ``st`` (what the reference returns)."""
  return jax.eval_shape(lambda a, b: _dot(a, b, st), a, w).dtype


def _pallas_into(out, piece, w, row, st: Static):
  """The Pallas kernel on the 2-D view: rows first, so ``rest`` folds into rows."""
  from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

  fold = math.prod(piece.shape[1:-1])
  y = chunk_matmul.chunk_matmul_into(
      out.reshape(-1, out.shape[-1]), piece.reshape(-1, piece.shape[-1]), w,
      row * fold, num_sms=st.schedule.num_sms)
  return y.reshape(out.shape)


def _pallas_pieces_into(out, data, blocks, w, rank, m, st: Static):
  """Every block of ``data`` times ``w``, written at its owner's rows of
  ``out``: one Pallas launch for a step (the direct dataflow's blocks all
  have the same rows)."""
  from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

  rows = {b.rows for b in blocks}
  if len(rows) != 1:
    raise ValueError(
        f"compute_granularity='step' with compute='pallas' needs the blocks"
        f" of a step to have equal rows, got {sorted(rows)}.")
  fold = math.prod(data.shape[1:-1])
  y = chunk_matmul.chunk_matmul_pieces(
      data.reshape(-1, data.shape[-1]),
      [b.landing_row * fold for b in blocks], rows.pop() * fold, w,
      out=out.reshape(-1, out.shape[-1]),
      out_rows=[(gather.owner_rank(b, rank, st.axis_size) * m + b.owner_row)
                * fold for b in blocks],
      num_sms=st.schedule.num_sms)
  return y.reshape(out.shape)


def _place(out, piece, w, row, st: Static):
  """Writes ``piece @ w`` into rows ``[row, row + len(piece))`` of ``out``."""
  if st.schedule.compute == "pallas":
    # The kernel writes its tile rows straight into `out` (aliased): no
    # update-slice copy follows it.
    return _pallas_into(out, piece, w, row, st)
  y = _dot(piece, w, st).astype(out.dtype)
  return lax.dynamic_update_slice_in_dim(out, y, row, axis=0)


def forward(x0: jax.Array, w: jax.Array, st: Static) -> jax.Array:
  """``all_gather(x0, tiled) @ w`` with the schedule in ``st``."""
  p, m = st.axis_size, x0.shape[0]
  out_dtype = dot_dtype(x0, w, st)
  if not st.schedule.overlapped or p == 1:
    gathered = lax.all_gather(x0, st.axis_name, axis=0, tiled=True)
    return _dot(gathered, w, st).astype(out_dtype)

  rank = lax.axis_index(st.axis_name)
  gplan = plan_lib.gather_plan(st.schedule, axis_size=p, shard_rows=m)
  # Every row is written exactly once below; zeros only give XLA a buffer
  # to update in place.
  out = jnp.zeros((p * m,) + x0.shape[1:-1] + (w.shape[1],), out_dtype)

  def consume(out, data, blocks):
    if st.schedule.granularity(st.op_name) == "step" and len(blocks) > 1:
      if st.schedule.compute == "pallas":
        # One launch writes every block at its owner's rows (in place).
        return _pallas_pieces_into(out, data, blocks, w, rank, m, st)
      # One matmul for the whole landing buffer (all peers' piece c in the
      # direct dataflow), then place its row blocks.
      y = _dot(data, w, st).astype(out_dtype)
      for b in blocks:
        row = gather.owner_rank(b, rank, p) * m + b.owner_row
        piece = lax.slice_in_dim(y, b.landing_row, b.landing_row + b.rows)
        out = lax.dynamic_update_slice_in_dim(out, piece, row, axis=0)
      return out
    for b in blocks:
      row = gather.owner_rank(b, rank, p) * m + b.owner_row
      piece = data
      if b.rows != data.shape[0]:
        piece = lax.slice_in_dim(data, b.landing_row, b.landing_row + b.rows)
      out = _place(out, piece, w, row, st)
    return out

  out, keepalive = gather.run(x0, gplan, axis_name=st.axis_name,
                              comm=st.schedule.comm, consume=consume,
                              carry=out, op_name=st.op_name,
                              timeout_s=st.timeout_s)
  out = gather.finish(out, keepalive, comm=st.schedule.comm,
                      axis_name=st.axis_name, op_name=st.op_name,
                      timeout_s=st.timeout_s)
  # The Pallas kernel's in-place writes leave `out` typed invariant.
  return vma.vary_like(out, x0, w)


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
  acc_dtype = jnp.promote_types(jnp.promote_types(a0.dtype, g0.dtype),
                                jnp.float32)

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
      piece = data
      if b.rows != data.shape[0]:
        piece = lax.slice_in_dim(data, b.landing_row, b.landing_row + b.rows)
      other = lax.dynamic_slice_in_dim(full, row, b.rows, axis=0)
      acc = acc + contract(piece, other)
    return acc

  acc = jnp.zeros((a0.shape[-1], g0.shape[-1]), acc_dtype)
  acc, keepalive = gather.run(shard, gplan, axis_name=st.axis_name,
                              comm=schedule.comm, consume=consume, carry=acc,
                              op_name=st.op_name, timeout_s=st.timeout_s)
  return gather.finish(acc, keepalive, comm=schedule.comm,
                       axis_name=st.axis_name, op_name=st.op_name,
                       timeout_s=st.timeout_s)
