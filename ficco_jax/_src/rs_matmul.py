"""psum_scatter(h @ w): partial products computed piecewise and reduced on the way.

Shapes after the scattered axis is moved first: ``h0 [P * m, *rest, F]`` (the
local columns of every row), ``w [F, N]``, result ``[m, *rest, N]`` (this
rank's rows of the sum over ranks).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import ag_matmul


def _dot(a, w, st: ag_matmul.Static):
  return ag_matmul._dot(a, w, st)  # pylint: disable=protected-access


def _rows(h0, start, size):
  return lax.dynamic_slice_in_dim(h0, start, size, axis=0)


def _send(x, axis_name, shift, p):
  # Rank i sends to rank (i + shift) % p.
  return lax.ppermute(x, axis_name, perm=[(i, (i + shift) % p) for i in range(p)])


def _ring(h0, w, st, rank, m, row0, rows, direction):
  """Accumulate-and-forward ring over rows [row0, row0 + rows) of each block.

  At step t rank r adds its partial for block j_t and passes the sum on in
  ``direction``; the last step's block is r's own, so the sum lands home.
  """
  p = st.axis_size
  acc = None
  for step in range(p):
    block = (rank - direction * (1 + step)) % p
    part = _dot(_rows(h0, block * m + row0, rows), w, st)
    if acc is not None:
      received = _send(acc, st.axis_name, direction, p)
      acc_dtype = _acc_dtype(part.dtype)
      part = part.astype(acc_dtype) + received.astype(acc_dtype)
    acc = part.astype(_out_dtype(h0, w, st))
  return acc


def _acc_dtype(dtype):
  # Sums of partials run in at least float32 (float64 stays float64).
  return jnp.promote_types(dtype, jnp.float32)


def _out_dtype(h0, w, st):
  return jax.eval_shape(lambda a, b: _dot(a, b, st), h0, w).dtype


def forward(h0: jax.Array, w: jax.Array, st: ag_matmul.Static) -> jax.Array:
  """``psum_scatter(h0 @ w, tiled)`` along the first axis, per ``st.schedule``."""
  p = st.axis_size
  schedule = st.schedule
  out_dtype = _out_dtype(h0, w, st)
  if not schedule.overlapped or p == 1:
    return lax.psum_scatter(_dot(h0, w, st), st.axis_name,
                            scatter_dimension=0, tiled=True).astype(out_dtype)
  if schedule.comm == "dma":
    raise NotImplementedError(
        "matmul_reduce_scatter with comm='dma' is not implemented yet; use"
        " Schedule(comm='xla') (same dataflows over lax.ppermute)."
    )
  m = h0.shape[0] // p
  mc = m // schedule.num_chunks
  rank = lax.axis_index(st.axis_name)
  chunks = []
  for c in range(schedule.num_chunks):
    row0 = c * mc
    if schedule.dataflow == "direct":
      # Partials for peers first, so their transfers start while this rank
      # multiplies its own rows.
      received = []
      for shift in range(1, p):
        dest = (rank + shift) % p
        part = _dot(_rows(h0, dest * m + row0, mc), w, st)
        received.append(_send(part, st.axis_name, shift, p))
      acc = _dot(_rows(h0, rank * m + row0, mc), w, st)
      acc = acc.astype(_acc_dtype(acc.dtype))
      for r in received:
        acc = acc + r.astype(acc.dtype)
      chunks.append(acc.astype(out_dtype))
    elif schedule.dataflow == "ring":
      chunks.append(_ring(h0, w, st, rank, m, row0, mc, +1))
    elif schedule.dataflow == "bidirectional":
      # Half of each piece's rows reduce around each direction, so both
      # directions of every link carry half of the bytes.
      half = mc // 2
      parts = []
      if half:
        parts.append(_ring(h0, w, st, rank, m, row0, half, +1))
      parts.append(_ring(h0, w, st, rank, m, row0 + half, mc - half, -1))
      chunks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0))
    else:
      raise ValueError(f"Unknown dataflow {schedule.dataflow!r}.")
  return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, 0)
