"""The overlapped all-gather engine: pieces of peer shards, each consumed on arrival.

Both ops and both directions of autodiff need "gather the shards of an axis
piece by piece and do something with each piece as it lands": the forward
all-gather matmul multiplies each piece by ``w`` (and may keep the pieces
for its gradient), the reduce-scatter's gradient multiplies the
cotangent's, the push all-gather's ``dw`` accumulates ``piece^T @ g``.
This module runs a `plan.GatherPlan`
with either communication engine and hands every landed piece, together with
where it belongs, to a consumer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import plan as plan_lib
from ficco_jax._src.matmul import Static


@dataclasses.dataclass(frozen=True)
class Pending:
  """What `finish` needs from `run`: the buffers peers may still read, and
  the peer-copy call site (None for comm="xla")."""

  arrays: tuple[jax.Array, ...]
  site: int | None


# consume(carry, data, placements) -> carry. `data` is [rows, ...]; each
# placement says which of its rows hold which rows of which rank's shard.
Consumer = Callable[[Any, jax.Array, Sequence[plan_lib.Block]], Any]


def own_blocks(shard_rows: int) -> tuple[plan_lib.Block, ...]:
  return (plan_lib.Block(landing=-1, landing_row=0, owner_offset=0,
                         owner_row=0, rows=shard_rows),)


def owner_rank(block: plan_lib.Block, rank: jax.Array, axis_size: int):
  """Runtime rank that owns a block's rows."""
  return (rank + block.owner_offset) % axis_size


def block_rows(data: jax.Array, block: plan_lib.Block) -> jax.Array:
  """The rows of a landing buffer (or the own shard) that ``block``
  places."""
  if block.rows == data.shape[0]:
    return data
  return lax.slice_in_dim(data, block.landing_row,
                          block.landing_row + block.rows)


def shift_row(block: plan_lib.Block, axis_size: int, shard_rows: int) -> int:
  """Where ``block``'s rows go in shift order (block ``s`` of the gathered
  rows holds rank ``r + s``'s shard): a static row, the same on every
  rank."""
  return (block.owner_offset % axis_size) * shard_rows + block.owner_row


def _permute(piece, axis_name, src_offset, p):
  # Rank i receives from rank (i + src_offset) % p.
  perm = [((i + src_offset) % p, i) for i in range(p)]
  return lax.ppermute(piece, axis_name, perm=perm)


def _run_xla(x0, gplan, axis_name, consume, carry):
  p = gplan.axis_size
  landings: list[jax.Array] = []
  for b, rows in enumerate(gplan.landing_rows):
    pieces = []
    for t in sorted((t for t in gplan.transfers if t.dst == b),
                    key=lambda t: t.dst_row):
      src = x0 if t.src >= 0 else landings[-1 - t.src]
      piece = lax.slice_in_dim(src, t.src_row, t.src_row + t.rows, axis=0)
      pieces.append(_permute(piece, axis_name, t.src_offset, p))
    landing = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, 0)
    assert landing.shape[0] == rows
    landings.append(landing)
  # The local shard needs no transfer: consuming it first lets XLA overlap
  # its matmul with the first permutes.
  carry = consume(carry, x0, own_blocks(gplan.shard_rows))
  for b, landing in enumerate(landings):
    carry = consume(carry, landing, gplan.blocks_of(b))
  return carry, ()


def _run_dma(x0, gplan, st: Static, consume, carry):
  from ficco_jax._src.dma import peer_copy  # Loads the FFI library lazily.

  site = peer_copy.new_site()
  kw = st.copy_kwargs()
  landings = peer_copy.start([x0], gplan, site=site, **kw)
  # Tie the local matmul to start so XLA issues every copy first: the copies
  # then run on the copy engines while the local shard is multiplied.
  x0_ordered, landings = lax.optimization_barrier((x0, list(landings)))
  carry = consume(carry, x0_ordered, own_blocks(gplan.shard_rows))
  waited = []
  for b, landing in enumerate(landings):
    # XLA only orders custom calls by data dependencies; without this barrier
    # it may hoist every wait above every matmul, and the compute stream
    # would sit idle until the last piece landed. Waiting for piece b after
    # the work on piece b - 1 was issued keeps one piece of lookahead.
    carry, landing = lax.optimization_barrier((carry, landing))
    buf = peer_copy.wait(landing, site=site, **kw)
    carry = consume(carry, buf, gplan.blocks_of(b))
    waited.append(buf)
  # Peers read our shard (and, in rings, the pieces we forward) until their
  # copies finish; `finish` keeps these buffers alive until then.
  keepalive = (x0,) + tuple(waited[j] for j in gplan.forwarded_landings)
  return carry, Pending(arrays=keepalive, site=site)


def run(x0: jax.Array, gplan: plan_lib.GatherPlan, st: Static, *,
        consume: Consumer, carry: Any) -> tuple[Any, Pending]:
  """Gathers the shards of ``st.axis_name`` piecewise into ``consume``.

  Args:
    x0: the local shard, rows first: ``[shard_rows, ...]``.
    gplan: the transfer plan (``gplan.shard_rows == x0.shape[0]``).
    st: the call's config: its schedule's ``comm`` picks ``lax.ppermute``
      (``"xla"``) or the copy engines (``"dma"``, over its ``transport``).
    consume: called once for the local shard, then once per landing buffer
      in plan order.
    carry: the consumer's initial state.

  Returns:
    ``(carry, pending)``. Pass the result that depends on every piece and
    ``pending`` to `finish` before using it.
  """
  comm = st.schedule.comm
  if comm == "xla":
    carry, _ = _run_xla(x0, gplan, st.axis_name, consume, carry)
    return carry, Pending(arrays=(), site=None)
  if comm == "dma":
    return _run_dma(x0, gplan, st, consume, carry)
  raise ValueError(f"Unknown {comm=}.")


def finish(result: jax.Array, pending: Pending, st: Static) -> jax.Array:
  """Returns ``result`` once no peer reads this device's buffers any more."""
  if st.schedule.comm != "dma":
    return result
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  return peer_copy.done(result, pending.arrays, site=pending.site,
                        **st.copy_kwargs())
