"""Rank-relative transfer plans for the all-gather side of a collective matmul.

A plan says, for one dataflow and chunk count, which pieces of which shards
land in which buffers, in what order, and where each piece goes in the
gathered operand. Every quantity is relative to the executing rank ``r``
(``source rank = (r + src_offset) % P``), so one plan is the same on every
device: it can be an attribute of an SPMD program. Both communication
engines consume the same plan: ``comm="xla"`` turns each transfer into a
``lax.ppermute``, ``comm="dma"`` hands the plan to the copy-engine FFI.
"""

from __future__ import annotations

import dataclasses

from ficco_jax._src import schedule as schedule_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transfer:
  """One contiguous copy of ``rows`` rows into a landing buffer.

  Attributes:
    dst: index of the landing buffer on the receiving rank.
    dst_row: first row written in that landing buffer.
    src_offset: the source is rank ``(r + src_offset) % P``; in ``1..P-1``.
    src: ``>= 0``: index into the op's source operands (the local shard is
      source 0). ``< 0``: landing buffer ``-1 - src`` of the source rank, which
      the source rank itself received earlier in the same plan (ring
      forwarding); the copy must wait for that buffer to arrive there.
    src_row: first row read from the source.
    rows: rows copied.
    stream: copy queue on the receiving device (``0 .. num_streams - 1``);
      transfers on one queue run in order, different queues concurrently.
  """

  dst: int
  dst_row: int
  src_offset: int
  src: int
  src_row: int
  rows: int
  stream: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
  """Where a landed piece belongs in the gathered operand.

  Rows ``[landing_row, landing_row + rows)`` of landing buffer ``landing`` are
  rows ``[owner_row, owner_row + rows)`` of the shard of rank
  ``(r + owner_offset) % P``.
  """

  landing: int
  landing_row: int
  owner_offset: int
  owner_row: int
  rows: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherPlan:
  """Everything the engines need to gather ``P - 1`` peer shards piecewise.

  Attributes:
    axis_size: ``P``, devices along the gathered axis.
    shard_rows: rows of every shard (the local operand's leading dim).
    landing_rows: rows of each landing buffer, in consumption order.
    transfers: every copy, in issue order.
    blocks: where each landed piece goes, grouped by landing buffer.
    num_streams: copy queues a receiving device uses.
  """

  axis_size: int
  shard_rows: int
  landing_rows: tuple[int, ...]
  transfers: tuple[Transfer, ...]
  blocks: tuple[Block, ...]
  num_streams: int

  def blocks_of(self, landing: int) -> tuple[Block, ...]:
    return tuple(b for b in self.blocks if b.landing == landing)

  @property
  def forwarded_landings(self) -> tuple[int, ...]:
    """Landing buffers that a peer reads from (they must outlive its copy)."""
    return tuple(sorted({-1 - t.src for t in self.transfers if t.src < 0}))


def _chunk_rows(shard_rows: int, num_chunks: int) -> int:
  if shard_rows % num_chunks:
    raise ValueError(
        f"num_chunks={num_chunks} must divide the local shard's gathered"
        f" dimension ({shard_rows})."
    )
  return shard_rows // num_chunks


def gather_plan(
    schedule: schedule_lib.Schedule, *, axis_size: int, shard_rows: int
) -> GatherPlan:
  """Builds the plan of an overlapped dataflow.

  Args:
    schedule: an overlapped schedule (``dataflow != "none"``).
    axis_size: devices along the gathered axis, ``P >= 1``.
    shard_rows: rows of each device's shard.

  Returns:
    The plan. Landing buffers are listed in the order compute consumes them;
    with ``P == 1`` there is nothing to move and the plan is empty.
  """
  p, c = axis_size, schedule.num_chunks
  mc = _chunk_rows(shard_rows, c)
  landing_rows: list[int] = []
  transfers: list[Transfer] = []
  blocks: list[Block] = []

  def add_piece(dst, dst_row, src_offset, src, src_row, owner_offset, chunk,
                stream):
    transfers.append(Transfer(dst=dst, dst_row=dst_row, src_offset=src_offset,
                              src=src, src_row=src_row, rows=mc,
                              stream=stream))
    blocks.append(Block(landing=dst, landing_row=dst_row,
                        owner_offset=owner_offset, owner_row=chunk * mc,
                        rows=mc))

  if p == 1:
    pass
  elif schedule.dataflow == "direct":
    # One landing buffer per chunk index holds that piece of every peer, so a
    # single matmul consumes all of them: the decomposition is finer than the
    # shard for the copies, but the matmul stays (P - 1) pieces tall. One copy
    # queue per peer lets every link of a fully connected topology work.
    for chunk in range(c):
      dst = len(landing_rows)
      landing_rows.append((p - 1) * mc)
      for k, shift in enumerate(range(1, p)):
        add_piece(dst, k * mc, shift, 0, chunk * mc, shift, chunk, stream=k)
  elif schedule.dataflow in ("ring", "bidirectional"):
    # Chains of forwarding: at step t a device receives the shard of rank
    # r -/+ t from its neighbour, which received it at step t - 1. A
    # bidirectional schedule runs two chains, each with half of the shards.
    if schedule.dataflow == "ring":
      chains = [(-1, p - 1)]
    else:
      chains = [(-1, p // 2), (+1, (p - 1) // 2)]
    index: dict[tuple[int, int, int], int] = {}
    for step in range(1, max(n for _, n in chains) + 1):
      for chunk in range(c):
        for stream, (direction, steps) in enumerate(chains):
          if step > steps:
            continue
          dst = len(landing_rows)
          landing_rows.append(mc)
          index[(direction, step, chunk)] = dst
          if step == 1:
            src, src_row = 0, chunk * mc
          else:
            src, src_row = -1 - index[(direction, step - 1, chunk)], 0
          add_piece(dst, 0, direction % p, src, src_row,
                    (direction * step) % p, chunk, stream)
  else:
    raise ValueError(f"No transfer plan for {schedule.dataflow=}.")

  num_streams = 1 + max((t.stream for t in transfers), default=0)
  return GatherPlan(axis_size=p, shard_rows=shard_rows,
                    landing_rows=tuple(landing_rows),
                    transfers=tuple(transfers), blocks=tuple(blocks),
                    num_streams=num_streams)


def owner_pulls(gplan: GatherPlan) -> GatherPlan:
  """The same plan with every piece read from the rank that owns it.

  The window transport stages each rank's shard in memory every peer has
  mapped, so a ring's forwarded piece (``src < 0``: read from the landing
  buffer of the rank that received it) can be pulled from its owner instead,
  with no wait for the forwarder. Landing buffers, their order, blocks and
  queues are unchanged, so the consumer sees the same arrivals in the same
  order; only the links used differ (every pair is direct on NVSwitch).
  Plans without forwarding are returned as they are.
  """
  if all(t.src >= 0 for t in gplan.transfers):
    return gplan
  p = gplan.axis_size
  transfers = []
  for t in gplan.transfers:
    if t.src >= 0:
      transfers.append(t)
      continue
    # Rows [src_row, src_row + rows) of the forwarder's landing buffer hold
    # pieces of the shards named by its blocks (relative to the forwarder).
    landing, lo, hi = -1 - t.src, t.src_row, t.src_row + t.rows
    for b in gplan.blocks_of(landing):
      a, z = max(lo, b.landing_row), min(hi, b.landing_row + b.rows)
      if a >= z:
        continue
      owner = (t.src_offset + b.owner_offset) % p
      assert owner != 0, "a rank never receives its own shard"
      transfers.append(dataclasses.replace(
          t, dst_row=t.dst_row + (a - lo), src_offset=owner, src=0,
          src_row=b.owner_row + (a - b.landing_row), rows=z - a))
  return dataclasses.replace(gplan, transfers=tuple(transfers))
