"""The schedule design space: how one collective matmul is decomposed and overlapped."""

from __future__ import annotations

import dataclasses
from typing import Literal

Dataflow = Literal["none", "ring", "bidirectional", "direct"]
Comm = Literal["xla", "dma"]
Compute = Literal["xla", "pallas"]

DATAFLOWS: tuple[str, ...] = ("none", "ring", "bidirectional", "direct")
COMMS: tuple[str, ...] = ("xla", "dma")
COMPUTES: tuple[str, ...] = ("xla", "pallas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """One point of the FiCCO design space.

  Frozen and hashable, so it can be a `jax.jit` static argument, a set member
  and an autotune-cache value.

  Attributes:
    dataflow: how shards move between the devices of the axis.
      * ``"none"``: no overlap; one XLA collective, then one matmul. What the
        heuristic picks when overlapping would lose (tiny ops).
      * ``"ring"``: shards travel around the ring (device ``r`` receives from
        ``r - 1``), ``P - 1`` steps.
      * ``"bidirectional"``: two rings in opposite directions, each carrying
        half of the shards, ``ceil((P - 1) / 2)`` steps; uses both directions
        of every link.
      * ``"direct"``: every device pulls a piece of every peer's shard at once
        (FiCCO's finer-than-shard all-to-all pulls); uses every link of a
        fully connected topology.
    num_chunks: pieces each shard is cut into, one level below the shard. A
      piece is the unit of transfer and of compute: the matmul on piece ``c``
      overlaps the transfer of piece ``c + 1``. Must divide the sharded
      dimension of the local operand.
    comm: engine that moves the pieces. ``"xla"`` uses ``lax.ppermute`` (any
      backend). ``"dma"`` drives the GPU copy engines through the ficco XLA
      FFI custom calls (a CPU twin runs the same protocol on CPU devices).
    compute: what multiplies the pieces. ``"xla"`` emits ``lax.dot_general``;
      ``"pallas"`` uses ficco's Pallas kernels, which write each product in
      place into the output.
    num_sms: occupancy knob for ``compute="pallas"``: the most streaming
      multiprocessors a chunk kernel may occupy (None: all of them). Leaving
      SMs idle lowers the interference between copy-engine traffic and the
      matmul. Ignored by ``compute="xla"``.
  """

  dataflow: Dataflow = "direct"
  num_chunks: int = 1
  comm: Comm = "xla"
  compute: Compute = "xla"
  num_sms: int | None = None

  def __post_init__(self):
    if self.dataflow not in DATAFLOWS:
      raise ValueError(f"{self.dataflow=} must be one of {DATAFLOWS}.")
    if self.comm not in COMMS:
      raise ValueError(f"{self.comm=} must be one of {COMMS}.")
    if self.compute not in COMPUTES:
      raise ValueError(f"{self.compute=} must be one of {COMPUTES}.")
    if isinstance(self.num_chunks, bool) or not isinstance(self.num_chunks, int):
      raise TypeError(f"{self.num_chunks=} must be an int.")
    if self.num_chunks < 1:
      raise ValueError(f"{self.num_chunks=} must be >= 1.")
    if self.dataflow == "none" and self.num_chunks != 1:
      raise ValueError(
          f"{self.num_chunks=} must be 1 with dataflow='none' (no overlap, so"
          " nothing to chunk)."
      )
    if self.num_sms is not None and (
        isinstance(self.num_sms, bool)
        or not isinstance(self.num_sms, int)
        or self.num_sms < 1
    ):
      raise ValueError(f"{self.num_sms=} must be None or a positive int.")

  @property
  def overlapped(self) -> bool:
    return self.dataflow != "none"

  def short(self) -> str:
    """A compact label, e.g. ``direct/c4/dma/xla``."""
    s = f"{self.dataflow}/c{self.num_chunks}/{self.comm}/{self.compute}"
    if self.num_sms is not None:
      s += f"/sm{self.num_sms}"
    return s


NO_OVERLAP = Schedule(dataflow="none", num_chunks=1, comm="xla", compute="xla")
