"""The reduce-scatter's ring and bidirectional dataflows on the copy engines.

Shapes as in `pieces`: ``h0 [P * m, *rest, F]``, ``w [F, N]``; chunks of
``mc = m / num_chunks`` rows.
"""

from __future__ import annotations

from jax import lax

from ficco_jax._src import matmul
from ficco_jax._src.matmul import Static
from ficco_jax._src.ops.matmul_reduce_scatter import pieces


def _ring(h0, w, st: Static, m, row0, rows, direction, out_dtype, ends):
  """Accumulate-and-forward ring; each hop is one copy-engine pull.

  While the running sum of step t travels to the next rank, this rank
  multiplies its partial for step t + 1. Each hop's sent sum must outlive
  the neighbour's read: it is appended to ``ends`` (keepalive, site), which
  the caller ends in one call after the whole op. So every sent sum of every
  chunk and direction stays live until then: ``(P - 1) m`` rows per op (m:
  this rank's output rows), plus the sum being received, against ``P m``
  for XLA's full partial product.
  """
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  kw = st.copy_kwargs()
  p = st.axis_size
  # Rank r pulls the running sum of rank r - direction: a one-peer group.
  gplan = pieces.group_plan(p, rows, (direction,))
  # Rank r's block at `step`; r is an int or the traced rank (`pieces_dot`).
  row_of = lambda step: (
      lambda r: (r - direction * (1 + step)) % p * m + row0)
  acc = pieces.rows_dot(h0, row_of(0), rows, w, st).astype(out_dtype)
  for step in range(1, p):
    site = peer_copy.new_site()
    landing = peer_copy.start([acc], gplan, site=site, **kw)[0]
    h0, landing = lax.optimization_barrier((h0, landing))
    part = pieces.rows_dot(h0, row_of(step), rows, w, st)
    part, landing = lax.optimization_barrier((part, landing))
    received = peer_copy.wait(landing, site=site, **kw)
    acc_dtype = matmul.acc_dtype(part.dtype)
    ends.append(([acc], site))
    acc = (part.astype(acc_dtype)
           + received.astype(acc_dtype)).astype(out_dtype)
  return acc


def forward(h0, w, st: Static, m, mc, out_dtype):
  """``psum_scatter(h0 @ w)`` around one ring (``"ring"``) or two in
  opposite directions, half of each chunk's rows each (``"bidirectional"``).
  """
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  ends = []  # (keepalive, site) of every ring hop, ended together below.
  chunks = []
  for c in range(st.schedule.num_chunks):
    row0 = c * mc
    if st.schedule.dataflow == "ring":
      chunks.append(_ring(h0, w, st, m, row0, mc, +1, out_dtype, ends))
      continue
    half = mc // 2
    parts = []
    if half:
      parts.append(_ring(h0, w, st, m, row0, half, +1, out_dtype, ends))
    parts.append(_ring(h0, w, st, m, row0 + half, mc - half, -1, out_dtype,
                       ends))
    chunks.append(pieces.concat_rows(parts))
  out = pieces.concat_rows(chunks)
  return peer_copy.sync([], ends, out=out, **st.copy_kwargs())[0]
