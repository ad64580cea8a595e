"""The reduce-scatter's dataflows on ``comm="xla"``: partials sent with
``lax.ppermute``, on any backend."""

from __future__ import annotations

from jax import lax

from ficco_jax._src import matmul
from ficco_jax._src.matmul import Static
from ficco_jax._src.ops.matmul_reduce_scatter import pieces


def _send(x, axis_name, shift, p):
  # Rank i sends to rank (i + shift) % p.
  return lax.ppermute(x, axis_name,
                      perm=[(i, (i + shift) % p) for i in range(p)])


def _ring(h0, w, st: Static, m, row0, rows, direction, dtype):
  """Accumulate-and-forward ring over rows [row0, row0 + rows) of each block.

  At step t rank r adds its partial for block j_t and passes the sum on in
  ``direction``; the last step's block is r's own, so the sum lands home.
  """
  p = st.axis_size
  acc = None
  for step in range(p):
    part = pieces.rows_dot(
        h0, lambda r, step=step: (r - direction * (1 + step)) % p * m + row0,
        rows, w, st)
    if acc is not None:
      received = _send(acc, st.axis_name, direction, p)
      acc_dtype = matmul.acc_dtype(part.dtype)
      part = part.astype(acc_dtype) + received.astype(acc_dtype)
    acc = part.astype(dtype)
  return acc


def _direct(h0, w, st: Static, m, row0, mc, dtype):
  """Every peer's partial of one chunk, sent as soon as it is multiplied,
  then the own rows' partial plus the received ones."""
  p = st.axis_size
  # Partials for peers first, so their transfers start while this rank
  # multiplies its own rows.
  received = []
  for shifts in pieces.shift_groups(st):
    parts = pieces.peers_dot(h0, w, st, m, row0, mc, shifts)
    for i, shift in enumerate(shifts):
      part = lax.slice_in_dim(parts, i * mc, (i + 1) * mc)
      received.append(_send(part, st.axis_name, shift, p))
  if st.schedule.reduce_in_epilogue:
    return pieces.rows_dot(h0, lambda r: r * m + row0, mc, w, st,
                           addends=received).astype(dtype)
  acc = pieces.rows_dot(h0, lambda r: r * m + row0, mc, w, st)
  acc = acc.astype(matmul.acc_dtype(acc.dtype))
  for r in received:
    acc = acc + r.astype(acc.dtype)
  return acc.astype(dtype)


def forward(h0, w, st: Static, m):
  """``psum_scatter(h0 @ w)`` on ``lax.ppermute``, chunk by chunk."""
  dtype = pieces.out_dtype(h0, w, st)
  dataflow = st.schedule.dataflow
  mc = m // st.schedule.num_chunks
  chunks = []
  for c in range(st.schedule.num_chunks):
    row0 = c * mc
    if dataflow == "direct":
      chunks.append(_direct(h0, w, st, m, row0, mc, dtype))
    elif dataflow == "ring":
      chunks.append(_ring(h0, w, st, m, row0, mc, +1, dtype))
    elif dataflow == "bidirectional":
      # Half of each piece's rows reduce around each direction, so both
      # directions of every link carry half of the bytes.
      half = mc // 2
      parts = []
      if half:
        parts.append(_ring(h0, w, st, m, row0, half, +1, dtype))
      parts.append(_ring(h0, w, st, m, row0 + half, mc - half, -1, dtype))
      chunks.append(pieces.concat_rows(parts))
    else:
      raise ValueError(f"Unknown dataflow {dataflow!r}.")
  return pieces.concat_rows(chunks)
