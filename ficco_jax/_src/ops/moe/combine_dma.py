"""The combine on the copy engines: each peer's products leave as soon as
they are multiplied.

Step k multiplies the rows of peer ``(rank + k) % P`` and hands the block
to the copy engines; that peer pulls it (the reduce-scatter's one-shift
plan, `pieces.group_plan`) while this device multiplies the next block.
The own block needs no copy. One sync at the end waits for every pulled
block and ends every invocation, and each block lands at the rows its
tokens came from.

Like the dispatch's, its gradient is the XLA ``direct`` combine's,
recomputed in the backward pass.
"""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp

from ficco_jax._src import matmul
from ficco_jax._src.ops.matmul_reduce_scatter import pieces as rs_pieces
from ficco_jax._src.ops.moe import exchange
from ficco_jax._src.ops.moe import routing as routing_lib


def _forward(h, w, r: routing_lib.Routing, num_tokens,
             st: exchange.MoeStatic, mst: matmul.Static):
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top
  kw = mst.copy_kwargs()
  p, t, cap = st.axis_size, num_tokens, st.piece_rows
  rank = lax.axis_index(st.axis_name)
  h_pad = jnp.pad(h, ((0, cap), (0, 0)))

  def block_for(src):
    rows = lax.dynamic_slice_in_dim(h_pad, r.recv_offset[src], cap, axis=0)
    return exchange.grouped(rows, w, r.recv[src], st)

  in_flight = []  # (k, block, landing, site)
  for k in range(1, p):
    block = block_for((rank + k) % p)
    site = peer_copy.new_site()
    landing = peer_copy.start([block], rs_pieces.group_plan(p, cap, [k]),
                              site=site, **kw)[0]
    # The next block's matmul reads h_pad through the barrier, so XLA
    # hands this block to the copy engines before it.
    h_pad, landing = lax.optimization_barrier((h_pad, landing))
    in_flight.append((k, block, landing, site))
  y = jnp.zeros((t + cap, w.shape[-1]), st.out_dtype)
  y = exchange.add_rows(y, block_for(rank), r.send_offset[rank])
  landings = tuple(f[2] for f in in_flight)
  y, landings = lax.optimization_barrier((y, landings))
  pulled = peer_copy.sync([(buf, f[3]) for buf, f in zip(landings, in_flight)],
                          [([f[1]], f[3]) for f in in_flight], **kw)
  for (k, *_), buf in zip(in_flight, pulled):
    # Pulled from device (rank - k) % P: this device's rows there.
    y = exchange.add_rows(y, buf, r.send_offset[(rank - k) % p])
  return y[:t]


def _on_xla(h, w, r, num_tokens, st, mst):
  del mst
  return exchange.combine(h, w, r, num_tokens,
                          dataclasses.replace(st, dataflow="direct"))


# combine(h, w, r, (num_tokens, st, mst)): `exchange.combine` with the blocks
# on the copy engines (``mst``: the call's copy-engine config).
combine = exchange.with_xla_gradient(_forward, _on_xla)
