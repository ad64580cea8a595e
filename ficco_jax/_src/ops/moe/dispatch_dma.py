"""The dispatch on the copy engines: every peer's piece is copied at once
(``comm="dma"``, the gather engine over the rendezvous or window transport),
the own piece is multiplied while they travel, and each landed piece is
waited for just before its grouped matmul.

The pieces go in *relative* order, ``pieces[k]`` being the rows for peer
``(rank + k) % P``, so the exchange is a static plan: copy k takes rows
``[k * cap, (k + 1) * cap)`` of rank ``rank - k`` into landing buffer
``k - 1``, the same on every rank.

The copy-engine primitives have no autodiff rules: the gradient is that of
the same dispatch over XLA's ``ppermute`` (`exchange.dispatch`), recomputed
in the backward pass.
"""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp

from ficco_jax._src import gather
from ficco_jax._src import matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src.ops.moe import exchange
from ficco_jax._src.ops.moe import routing as routing_lib


def all_to_all_plan(axis_size: int, cap: int) -> plan_lib.GatherPlan:
  """Peer k's piece (relative order) into its own landing buffer."""
  p = axis_size
  transfers, blocks = [], []
  for k in range(1, p):
    transfers.append(plan_lib.Transfer(
        dst=k - 1, dst_row=0, src_offset=p - k, src=0, src_row=k * cap,
        rows=cap, stream=k - 1))
    blocks.append(plan_lib.Block(landing=k - 1, landing_row=0,
                                 owner_offset=p - k, owner_row=k * cap,
                                 rows=cap))
  return plan_lib.GatherPlan(axis_size=p, shard_rows=p * cap,
                             landing_rows=(cap,) * (p - 1),
                             transfers=tuple(transfers), blocks=tuple(blocks),
                             num_streams=max(p - 1, 1))


def _forward(x, w, r: routing_lib.Routing, st: exchange.MoeStatic,
             mst: matmul.Static):
  p, cap = st.axis_size, st.piece_rows
  rank = lax.axis_index(st.axis_name)
  x_pad = jnp.pad(x, ((0, cap), (0, 0)))
  pieces = jnp.concatenate([
      lax.dynamic_slice_in_dim(x_pad, r.send_offset[(rank + k) % p], cap,
                               axis=0) for k in range(p)])

  def consume(out, data, blocks):
    [b] = blocks
    rows = data[:cap] if b.landing < 0 else data  # The own piece is first.
    src = (rank + b.owner_offset) % p
    block = exchange.grouped(rows, w, r.recv[src], st)
    return exchange.add_rows(out, block, r.recv_offset[src])

  out = jnp.zeros((st.capacity + cap, w.shape[-1]), st.out_dtype)
  out, pending = gather.run(pieces, all_to_all_plan(p, cap), mst,
                            consume=consume, carry=out)
  return gather.finish(out, pending, mst)[:st.capacity]


def _on_xla(x, w, r, st, mst):
  del mst
  return exchange.dispatch(x, w, r, dataclasses.replace(st, dataflow="direct"))


# dispatch(x, w, r, (st, mst)): `exchange.dispatch` with the pieces on the
# copy engines (``mst``: the call's copy-engine config).
dispatch = exchange.with_xla_gradient(_forward, _on_xla)
