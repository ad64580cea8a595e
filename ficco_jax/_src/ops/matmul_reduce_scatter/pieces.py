"""The reduce-scatter's building blocks: partial products of row pieces.

Shapes after the scattered axis is moved first: ``h0 [P * m, *rest, F]``
(the local columns of every row), ``w [F, N]``. Rank ``r``'s rows of the
result are rows ``[r m, (r + 1) m)`` of the sum over ranks of ``h0 @ w``;
every dataflow computes that sum from partials of row pieces, which these
helpers compute, hand over and add.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src.matmul import Static


def out_dtype(h0, w, st: Static):
  """The op's result dtype (``h0`` may carry `chunk_matmul.pad_k`'s zero
  columns past ``w``'s rows)."""
  return matmul.dot_dtype(
      jax.ShapeDtypeStruct(h0.shape[:-1] + w.shape[:1], h0.dtype), w, st)


def pieces_dot(h0, starts_of, rows, w, st: Static, *, addends=(),
               addend_rows=None, out=None, out_row=None, total_rows=None):
  """``h0[r:r + rows] @ w`` for each ``r`` in ``starts_of(rank)``, stacked,
  plus ``addends`` (rows ``addend_rows`` on, as `chunk_matmul_pieces`'s).

  With ``out_row`` (one piece, ``compute="pallas"``): the product is
  written at that row of ``out``, aliased, or of a fresh ``total_rows``-row
  array whose other rows are left unwritten (``out`` None).

  ``starts_of`` maps this device's rank along ``st.axis_name`` (a Python
  int, or the traced rank) to the first rows of the pieces. Taking it as a
  function lets ``compute="pallas"`` hand ficco's kernel every rank's rows
  as constants (`chunk_matmul.ByRank`): its only run-time operand is then
  the rank, which XLA computes once for all the op's launches.

  ``compute="pallas"`` runs ficco's kernel, which TMA-loads every piece's
  rows from ``h0`` in place, in one launch; XLA's dot needs them sliced out
  (and, for several pieces, copied together) first: a copy kernel per
  piece, ~4% of a 70B-class reduce-scatter on an H200.
  """
  rank = lax.axis_index(st.axis_name)
  if st.schedule.compute == "pallas":
    from ficco_jax._src.pallas import chunk_matmul  # pylint: disable=g-import-not-at-top

    fold = math.prod(h0.shape[1:-1])
    table = [[r0 * fold for r0 in starts_of(r)] for r in range(st.axis_size)]
    place = {}
    if out_row is not None:
      place["out_rows"] = [out_row * fold]
      if out is None:
        place["fresh_rows"] = total_rows * fold
      else:
        total_rows = out.shape[0]
        place["out"] = out.reshape(-1, out.shape[-1])
    y = chunk_matmul.chunk_matmul_pieces(
        h0.reshape(-1, h0.shape[-1]), chunk_matmul.ByRank(rank, table),
        rows * fold, w, num_sms=st.schedule.num_sms,
        preferred_element_type=out_dtype(h0, w, st),
        x_zero_padded_k=h0.shape[-1] != w.shape[0],
        addends=[a.reshape(-1, a.shape[-1]) for a in addends],
        addend_rows=(None if addend_rows is None
                     else [a0 * fold for a0 in addend_rows]),
        **place)
    lead = len(table[0]) * rows if out_row is None else total_rows
    return y.reshape((lead,) + h0.shape[1:-1] + (w.shape[1],))
  if addends or out_row is not None:
    raise ValueError("addends and out_row need compute='pallas' (Schedule"
                     " checks this).")
  starts = starts_of(rank)
  pieces = [lax.dynamic_slice_in_dim(h0, r, rows, axis=0) for r in starts]
  return matmul.dot(
      pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, 0), w, st)


def rows_dot(h0, start_of, size, w, st: Static, **addends):
  """``h0[start:start + size] @ w``, ``start = start_of(rank)``: one partial
  product (`pieces_dot`)."""
  return pieces_dot(h0, lambda r: [start_of(r)], size, w, st, **addends)


def shift_groups(st: Static) -> list[tuple[int, ...]]:
  """The direct dataflow's shifts ``1 .. P - 1`` (rank r's partial for rank
  r + s), cut into the schedule's peer groups: one dot and one hand-over
  per group (`Schedule.peer_groups`)."""
  out, s0 = [], 1
  for g in st.schedule.peer_groups(st.op_name, st.axis_size):
    out.append(tuple(range(s0, s0 + g)))
    s0 += g
  return out


def peers_dot(h0, w, st: Static, m, row0, rows, shifts):
  """One group's partials: rows ``[row0, row0 + rows)`` of the blocks of
  ranks ``r + s``, ``s`` in ``shifts``, times ``w``, stacked in that order
  (the blocks may wrap around this rank's own, so they need not be
  contiguous in ``h0``)."""
  p = st.axis_size
  return pieces_dot(
      h0, lambda r: [(r + s) % p * m + row0 for s in shifts], rows, w, st)


def group_plan(p: int, rows: int, shifts) -> plan_lib.GatherPlan:
  """Rank r pulls slot ``i`` of rank ``r - shifts[i]``'s group buffer.

  A group buffer holds one chunk's partials for ranks ``q + s``, ``s`` in
  ``shifts``, of its owner q, ``rows`` rows each, in that order, so the
  slot a puller reads depends only on the shift. One copy queue per shift:
  every device pulls from all the group's peers at once, as the
  all-gather's direct plan does. A one-shift group is a permutation: each
  device sends one piece and receives one, over one link (a ring hop's
  plan, with shift = its direction).
  """
  transfers = tuple(
      plan_lib.Transfer(dst=0, dst_row=i * rows, src_offset=(-s) % p,
                        src=0, src_row=i * rows, rows=rows, stream=i)
      for i, s in enumerate(shifts))
  return plan_lib.GatherPlan(axis_size=p, shard_rows=len(shifts) * rows,
                             landing_rows=(len(shifts) * rows,),
                             transfers=transfers, blocks=(),
                             num_streams=len(shifts))


def add_pulled(own, pulled, num_chunks, mc, dtype):
  """This rank's result: chunk j's own rows ``own[j mc:(j + 1) mc]`` plus
  every pulled ``[mc, n]`` partial ``(j, rows)`` of chunk j, in the order
  given, accumulated in f32 (or wider) and rounded once to ``dtype``."""
  acc_dtype = matmul.acc_dtype(own.dtype)
  chunks = []
  for j in range(num_chunks):
    acc = own[j * mc:(j + 1) * mc].astype(acc_dtype)
    for jj, rows in pulled:
      if jj == j:
        acc = acc + rows.astype(acc_dtype)
    chunks.append(acc.astype(dtype))
  return chunks[0] if num_chunks == 1 else jnp.concatenate(chunks, 0)


def concat_rows(parts):
  """The row blocks of a result, in order (no copy for one block)."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0)
