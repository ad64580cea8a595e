"""all_gather(x) @ w, piece by piece as the gather engine lands the pieces.

Shapes follow the public op after the gathered axis is moved first:
``x0 [m, *rest, K]`` (the local shard), ``w [K, n]``, result
``[P * m, *rest, n]`` in rank order along the first axis.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import gather
from ficco_jax._src import matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src import vma
from ficco_jax._src.matmul import Static


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
  y = matmul.dot(piece, w, st).astype(out.dtype)
  return lax.dynamic_update_slice_in_dim(out, y, row, axis=0)


def forward(x0: jax.Array, w: jax.Array, st: Static) -> jax.Array:
  """``all_gather(x0, tiled) @ w`` with the schedule in ``st``."""
  p, m = st.axis_size, x0.shape[0]
  out_dtype = matmul.dot_dtype(x0, w, st)
  if not st.schedule.overlapped or p == 1:
    gathered = lax.all_gather(x0, st.axis_name, axis=0, tiled=True)
    return matmul.dot(gathered, w, st).astype(out_dtype)

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
      y = matmul.dot(data, w, st).astype(out_dtype)
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

  out, pending = gather.run(x0, gplan, st, consume=consume, carry=out)
  out = gather.finish(out, pending, st)
  # The Pallas kernel's in-place writes leave `out` typed invariant.
  return vma.vary_like(out, x0, w)
