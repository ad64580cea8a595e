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

import jax
from jax import lax
import jax.numpy as jnp


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


def check_capacity(r: Routing, capacity: int, op_name: str,
                   axis_name: str) -> None:
  """Raises at run time (an error of the call, never a silent truncation)
  where a device would receive more rows than ``capacity``.

  The counts live on the devices; one host callback per call reads them.
  Every device checks every device's count, so all of them fail the call
  together (one failing alone would leave its peers waiting in the
  exchange).
  """
  totals = lax.all_gather(r.recv_total, axis_name)

  def check(totals):
    worst = int(totals.argmax())
    if int(totals[worst]) > capacity:
      raise ValueError(
          f"{op_name}: routing sends {int(totals[worst])} rows to device"
          f" {worst} of axis {axis_name!r}, more than capacity={capacity};"
          " raise capacity (the axis size times the tokens per device is"
          " always enough).")
  jax.debug.callback(check, totals)
