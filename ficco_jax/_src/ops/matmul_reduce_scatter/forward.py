"""psum_scatter(h @ w): partial products computed piecewise and reduced on
their way to the rank that owns their rows.

Shapes after the scattered axis is moved first: ``h0 [P * m, *rest, F]`` (the
local columns of every row), ``w [F, N]``, result ``[m, *rest, N]`` (this
rank's rows of the sum over ranks). One module per engine and dataflow:
`ppermute` (``comm="xla"``), `direct_dma`, `flagged` and `ring_dma`
(``comm="dma"``).
"""

from __future__ import annotations

import jax
from jax import lax

from ficco_jax._src import matmul
from ficco_jax._src.matmul import Static
from ficco_jax._src.ops.matmul_reduce_scatter import direct_dma
from ficco_jax._src.ops.matmul_reduce_scatter import flagged
from ficco_jax._src.ops.matmul_reduce_scatter import pieces
from ficco_jax._src.ops.matmul_reduce_scatter import ppermute
from ficco_jax._src.ops.matmul_reduce_scatter import ring_dma


def forward(h0: jax.Array, w: jax.Array, st: Static) -> jax.Array:
  """``psum_scatter(h0 @ w, tiled)`` along the first axis, per ``st.schedule``."""
  p = st.axis_size
  schedule = st.schedule
  if not schedule.overlapped or p == 1:
    out_dtype = pieces.out_dtype(h0, w, st)
    return lax.psum_scatter(matmul.dot(h0, w, st), st.axis_name,
                            scatter_dimension=0, tiled=True).astype(out_dtype)
  m = h0.shape[0] // p
  if schedule.compute == "pallas":
    from ficco_jax._src.pallas import chunk_matmul  # pylint: disable=g-import-not-at-top

    # Once per op, before the pieces: a K that leaves half a 64-deep step
    # over (qwen2-72b's 7392) gets zero columns, so the Hopper kernel runs
    # full-depth steps. Half-depth steps cost 20-25% of the matmul on an
    # H100; the copy is all of h once (60 MB at qwen2-72b M4096), and end to
    # end it runs level with XLA's dot.
    h0 = chunk_matmul.pad_k(h0)
  if schedule.comm == "xla":
    return ppermute.forward(h0, w, st, m)
  mc = m // schedule.num_chunks
  out_dtype = pieces.out_dtype(h0, w, st)
  if schedule.dataflow != "direct":
    return ring_dma.forward(h0, w, st, m, mc, out_dtype)
  if schedule.compute_granularity == "flagged":
    return flagged.forward(h0, w, st, m, mc, out_dtype)
  return direct_dma.forward(h0, w, st, m, mc, out_dtype)
