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
import functools

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import gather
from ficco_jax._src import matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src import schedule as schedule_lib
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
             schedule: schedule_lib.Schedule, timeout_s: float):
  p, t = st.axis_size, x.shape[0]
  cap = min(t, st.capacity)
  rank = lax.axis_index(st.axis_name)
  x_pad = jnp.pad(x, ((0, cap), (0, 0)))
  pieces = jnp.concatenate([
      lax.dynamic_slice_in_dim(x_pad, r.send_offset[(rank + k) % p], cap,
                               axis=0) for k in range(p)])
  mst = matmul.Static(axis_name=st.axis_name, axis_size=p, schedule=schedule,
                      precision=st.precision, preferred_element_type=None,
                      op_name=st.op_name, timeout_s=timeout_s)

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def dispatch(x, w, r, st, schedule, timeout_s):
  """`exchange.dispatch` with the pieces on the copy engines (``r``: the
  call's `routing_lib.Routing`, integer counts, not differentiated)."""
  return _forward(x, w, r, st, schedule, timeout_s)


def _fwd(x, w, r, st, schedule, timeout_s):
  return _forward(x, w, r, st, schedule, timeout_s), (x, w, r)


def _bwd(st, schedule, timeout_s, res, ct):
  del schedule, timeout_s
  x, w, r = res
  xla_st = dataclasses.replace(st, dataflow="direct")
  _, vjp = jax.vjp(lambda x, w: exchange.dispatch(x, w, r, xla_st), x, w)
  dx, dw = vjp(ct)
  return dx, dw, None


dispatch.defvjp(_fwd, _bwd)
