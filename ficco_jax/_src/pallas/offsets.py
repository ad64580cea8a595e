"""The row offsets the chunk-matmul kernels read at run time.

A kernel call computes one or more pieces; for each it takes the first row
it writes in the output and the first row it reads from x. Both kernels
take them as one ``(2 * pieces,)`` int32 operand (`piece_offsets`), read at
run time, so traced offsets (e.g. from ``lax.axis_index``) compile once for
all devices. A `ByRank` instead gives every rank's offsets statically: the
Hopper kernel compiles that table in and reads only the rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ByRank:
  """Piece offsets that depend only on this device's rank along a mesh axis.

  ``table[r]`` lists the offsets (one per piece) that rank ``r`` uses;
  ``rank`` is the traced rank (``lax.axis_index``, or the flagged
  reduce-scatter's `peer_copy.arm` rank, which spares the program XLA's
  partition-id). The Hopper kernel
  compiles the table in and reads only the rank at run time: every Pallas
  call of an op takes the same one-element operand, which XLA computes once
  (compiled HLO of a reduce-scatter: one ``partition-id``, one operand for
  its four kernels), instead of an offsets array per call, each its own
  tiny kernel launch (4 to 7 per reduce-scatter, ~1 us of device and
  several us of host time each, in a profile on 4xH200).

  Attributes:
    rank: int32 scalar, this device's rank in ``[0, len(table))``.
    table: per rank, one static offset per piece.
  """

  rank: Any
  table: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    table = tuple(tuple(int(v) for v in row) for row in self.table)
    if not table or len({len(row) for row in table}) != 1 or not table[0]:
      raise ValueError(
          f"ByRank.table must have one non-empty row per rank, all of one"
          f" length; got row lengths {[len(r) for r in table]}.")
    object.__setattr__(self, "table", table)

  def __len__(self) -> int:
    return len(self.table[0])

  def traced(self) -> list[jax.Array]:
    """This rank's offsets as traced int32 scalars (portable paths)."""
    t = jnp.asarray(np.asarray(self.table, np.int32))
    return [t[self.rank, i] for i in range(len(self))]


def offset_operand(row_offset, x_row_offset=0) -> jax.Array:
  """The offsets of one piece: see `piece_offsets`."""
  return piece_offsets([row_offset], [x_row_offset])


def piece_offsets(out_rows, x_rows) -> jax.Array:
  """A ``(2 * pieces,)`` int32 operand: the first row each piece is written
  at in out, then the first row each piece is read from in x. The kernels
  read it at run time, so traced offsets (e.g. from lax.axis_index) compile
  once for all devices."""
  return jnp.stack([jnp.asarray(r, jnp.int32)
                    for r in (*out_rows, *x_rows)])


def static_rows(offsets) -> list:
  """The offsets to check: a `ByRank`'s every rank's, else the list."""
  if isinstance(offsets, ByRank):
    return [v for row in offsets.table for v in row]
  return list(offsets)


def by_rank_offsets(dest_rows, x_rows) -> ByRank:
  """The kernel's ``2 * pieces`` offsets per rank, as a `ByRank`; a plain
  list (static ints) is the same for every rank."""
  # Both ByRank: they must hold the same rank (a traced value cannot be
  # compared here); the kernel reads the first one's.
  given = [o for o in (dest_rows, x_rows) if isinstance(o, ByRank)]
  ranks = {len(o.table) for o in given}
  if len(ranks) != 1:
    raise ValueError("out_rows and x_rows given as ByRank must have one row"
                     f" per rank each, got {sorted(ranks)} rows.")
  rows_of = lambda o, r: (o.table[r] if isinstance(o, ByRank)
                          else [int(v) for v in o])
  for o in (dest_rows, x_rows):
    if not isinstance(o, ByRank) and any(
        not isinstance(v, (int, np.integer)) for v in o):
      raise TypeError("With a ByRank offset list, the other list must hold"
                      " static ints (or be a ByRank too).")
  table = tuple(tuple(rows_of(dest_rows, r)) + tuple(rows_of(x_rows, r))
                for r in range(ranks.pop()))
  return ByRank(given[0].rank, table)
