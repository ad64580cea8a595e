"""Who sends which rows where: the counts of an expert-parallel exchange.

Device r of P owns experts ``[r * E_l, (r + 1) * E_l)``. A device's tokens
arrive sorted by (global) expert with per-expert counts ``group_sizes [E]``,
so the rows for device r's experts are one contiguous segment. The
receivers learn their counts with one small all-to-all of the count table
(on the device: no host round trip), then every peer's rows can be moved
and multiplied piece by piece.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["send", "send_offset", "recv", "recv_offset",
                                "recv_total"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Routing:
  """One device's view of the exchange (every field is per device).

  Attributes:
    send: ``[P, E_l]`` rows this device sends to peer r for its expert j.
    send_offset: ``[P]`` first row of the segment for peer r in the tokens.
    recv: ``[P, E_l]`` rows this device receives from peer s for its own
      expert j.
    recv_offset: ``[P]`` first row of peer s's block in the packed,
      source-major layout (`dispatch` output, `combine` input).
    recv_total: rows received in all.
  """

  send: jax.Array
  send_offset: jax.Array
  recv: jax.Array
  recv_offset: jax.Array
  recv_total: jax.Array


def exclusive_cumsum(v: jax.Array) -> jax.Array:
  return jnp.cumsum(v) - v


def route(group_sizes: jax.Array, *, axis_name: str,
          axis_size: int) -> Routing:
  """The routing of ``group_sizes`` (``[P * E_l]`` int) over ``axis_name``."""
  e_local = group_sizes.shape[0] // axis_size
  send = group_sizes.astype(jnp.int32).reshape(axis_size, e_local)
  send_total = send.sum(axis=1)
  # Row s of the received table: what peer s sends to this device's experts.
  recv = lax.all_to_all(send, axis_name, 0, 0, tiled=True)
  recv_total = recv.sum(axis=1)
  return Routing(send=send, send_offset=exclusive_cumsum(send_total),
                 recv=recv, recv_offset=exclusive_cumsum(recv_total),
                 recv_total=recv_total.sum())


def check(group_sizes: jax.Array, r: Routing, *, tokens: int, capacity: int,
          piece_rows: int, op_name: str, axis_name: str,
          capacity_of: str | None = None) -> None:
  """Raises at run time, as an error of the call, where the routing cannot
  be carried out as given: a negative count, more routed rows than the
  ``tokens`` a device has, more received rows than ``capacity``, or more
  rows from one peer than ``piece_rows`` (the ops' ``piece_capacity``). The
  exchange itself never fails on such counts (its slices clamp), so
  without this check they would silently give wrong rows.

  The counts live on the devices: one small all_gather and one host
  callback per call read them. Every device checks every device's counts,
  so all of them fail the call the same way (a device that raised alone
  aborted the CPU runtime in testing); each device's own counts are
  checked before anyone's capacity, since counts that are wrong somewhere
  make the received rows wrong everywhere.

  The exchange runs on int32 counts; the check reads them in their own
  dtype (a count past int32 would wrap in the cast), at least 32 bits of
  it, and sums them clipped at ``tokens + 1``, which no valid count
  exceeds, in that dtype (64 bits for int64 counts).
  """
  at_least = (jnp.uint32 if jnp.issubdtype(group_sizes.dtype,
                                           jnp.unsignedinteger)
              else jnp.int32)
  wide = jnp.promote_types(group_sizes.dtype, at_least)
  gs = group_sizes.astype(wide)
  routed = jnp.clip(gs, 0, tokens + 1).sum(dtype=wide)
  mine = jnp.stack([gs.min(), gs.max(), routed,
                    r.recv_total.astype(wide),
                    r.recv.sum(axis=1).max().astype(wide)])
  table = lax.all_gather(mine, axis_name)  # [P, 5]

  def raise_if_bad(table):
    rows = table.tolist()
    where = lambda dev: f"{op_name}: on device {dev} of axis {axis_name!r}, "
    for dev, (least, most, routed, _, _) in enumerate(rows):
      if least < 0:
        raise ValueError(where(dev) +
                         f"group_sizes has a negative count ({least}).")
      if most > tokens:
        raise ValueError(
            where(dev) + f"group_sizes has a count of {most}, more than the"
            f" {tokens} token rows there.")
      if routed > tokens:
        raise ValueError(
            where(dev) + f"group_sizes routes {routed} rows, more than the"
            f" {tokens} token rows there.")
    for dev, (_, _, _, received, piece) in enumerate(rows):
      if received > capacity and capacity_of is not None:
        raise ValueError(
            where(dev) + f"the routing returns {received} rows, more than"
            f" the {capacity} rows of {capacity_of}.")
      if received > capacity:
        raise ValueError(
            where(dev) + f"the routing sends {received} rows, more than"
            f" capacity={capacity}; raise capacity (the axis size times the"
            " tokens per device is always enough).")
      if piece > piece_rows:
        raise ValueError(
            where(dev) + f"one peer sends {piece} rows, more than the"
            f" {piece_rows} rows of a piece (piece_capacity); raise"
            " piece_capacity (the tokens per device are always enough).")
  jax.debug.callback(raise_if_bad, table)
