"""The schedule design space: how one collective matmul is decomposed and overlapped."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

Dataflow = Literal["none", "ring", "bidirectional", "direct"]
Comm = Literal["xla", "dma"]
Compute = Literal["xla", "pallas"]
Granularity = Literal["piece", "step", "halving", "flagged"]
Transport = Literal["rendezvous", "window", "push"]

DATAFLOWS: tuple[str, ...] = ("none", "ring", "bidirectional", "direct")
COMMS: tuple[str, ...] = ("xla", "dma")
COMPUTES: tuple[str, ...] = ("xla", "pallas")
GRANULARITIES: tuple[str, ...] = ("piece", "step", "halving", "flagged")
TRANSPORTS: tuple[str, ...] = ("rendezvous", "window", "push")


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
    compute_granularity: how much one dot covers, against the transfer
      unit (a piece of one peer's shard), FiCCO's compute granularity. It
      differs from the piece only where one dataflow step moves the pieces
      of several peers at once (``"direct"``); a ring step moves one piece,
      so there the two are the same.
      * ``"piece"``: one dot per piece of each peer. The all-gather
        multiplies each peer's piece separately; the reduce-scatter
        computes each peer's partial separately and hands it to the copy
        engines on its own (``P - 1`` copy-engine starts per chunk).
      * ``"step"``: one dot per step, over the pieces of every peer of that
        step (``(P - 1) m / num_chunks`` rows): fewer, larger dots (less
        decomposition loss) and, for the reduce-scatter, one copy-engine
        start per chunk for all peers (less host time per op), at the price
        of handing the partials over only once all of them are computed.
        ``compute="pallas"`` reads (reduce-scatter) or writes (all-gather)
        every piece of the step in place, in one kernel launch; XLA's dot
        needs the reduce-scatter's peer rows copied together first.
      * ``"halving"`` (reduce-scatter only): between the two, for ops whose
        host time shows but whose transfers still need hiding. Each chunk's
        peers are taken in groups that halve (`halving_groups`: 2 + 1 of
        the 3 peers of 4 devices, 4 + 2 + 1 of 7): one dot and one
        copy-engine start per group, so ``ceil(log2 P)`` per chunk instead
        of ``P - 1``, while each group's pulls overlap the later groups'
        dots and the own rows'. On 4 devices that is one host round trip
        and one kernel launch fewer per chunk than ``"piece"``, at the price
        of the first group's pulls starting one piece's dot later.
      * ``"flagged"`` (``dataflow="direct"``, ``comm="dma"``): pieces
        signalled on the device, one host call per op's side.
        All-gather (``compute="xla"``, ``num_chunks=1``): the push
        all-gather. One call pushes this rank's shard straight from XLA's
        buffer into every peer's window on the copy engines and flags its
        arrival there; the compute stream multiplies the own shard at once
        and each peer's shard where it landed in the window, behind a
        device-side wait for that peer's flag (``cuStreamWaitValue32``),
        writing each product in place into its rows of the result. No
        staging copy, no host rendezvous; the GEMMs are the BLAS library's
        (cuBLAS, as XLA's dots), since the window is memory outside XLA's
        buffers that neither an XLA dot nor a Pallas kernel can read.
        All-gather (``compute="pallas"``, any ``num_chunks``): the
        signalled all-gather. One window start pulls every peer's chunks
        into XLA's landing buffers on the copy engines, each queue setting
        a landing flag in device memory as its piece lands; the own
        shard's kernel runs meanwhile, then one kernel launch per chunk
        walks that chunk's pieces in landing order, each CTA waiting in
        the kernel for a piece's flag before it loads the piece: no stream
        wait and no launch per piece (XLA's thread waits on the host until
        the copies are enqueued, before the first such launch).
        Reduce-scatter (``compute="pallas"``): the overlap of
        ``"piece"`` at the host cost of ``"step"``. One kernel launch
        computes every piece of the op, peers' pieces first, and bumps a
        per-piece completion flag in device memory once each CTA has
        stored its tiles of that piece;
        one copy-engine start per op enqueues every pull behind a stream
        wait for its piece's flag (``cuStreamWaitValue32``), so each pull
        begins as soon as its piece is written, as with ``"piece"``, while
        the host runs one kernel launch and one start instead of one of
        each per piece. The pieces travel as ``transport`` says.
      * None: each op's own default: the all-gather ``"step"`` with
        ``compute="xla"`` and ``"piece"`` with ``compute="pallas"``; the
        reduce-scatter ``"piece"``.
    reduce_in_epilogue: the reduce-scatter's direct dataflow only (the
      all-gather, which reduces nothing, ignores it): this rank's own rows
      of each chunk are multiplied last, by a kernel that adds the partials
      pulled from the peers in its epilogue, instead of a separate pass
      over them after one matmul of all own rows. It saves that pass (it
      reads ``P`` and writes one output-sized buffer: 9% of a
      16384x8192x8192 op on 4 H200s, fully exposed), at the price of
      waiting for chunk ``c``'s pulls before chunk ``c``'s own rows: with
      ``num_chunks=1`` the last pull is exposed; with more, chunk ``c``'s
      own rows hide chunk ``c + 1``'s pulls. Needs ``compute="pallas"``.
      Slower than the separate pass on H200: the kernel reads the partials
      with element-wise loads (Mosaic GPU has no tiled GMEM-to-register
      transfer, and its stages fill shared memory). Opt-in; the heuristic
      and the autotune cache never pick it.
    transport: how ``comm="dma"`` pieces reach their peers
      (docs/protocol.md, docs/windows.md). None picks automatically:
      ``"push"`` for ``compute_granularity="flagged"`` (``"window"`` for
      the signalled all-gather, its only transport), else ``"window"``
      when the axis spans processes and ``"rendezvous"`` when every device
      of the axis is in this process (`resolved_transport`).
      * ``"rendezvous"``: the ranks of an op meet on the host once per call
        and copy between XLA's own buffers. One process only.
      * ``"window"``: each rank stages its sources in a window of memory
        every peer mapped once (peer access, or CUDA IPC across processes)
        and ranks synchronise through flags in the windows, with no host
        rendezvous. Works across the processes of one host.
      * ``"push"`` (``compute_granularity="flagged"`` only): each rank's
        copy engines push its pieces into the receivers' pooled windows,
        so a call needs no host rendezvous; one process or several. The
        push all-gather (flagged, ``compute="xla"``) travels by push only.
      Must be None with ``comm="xla"``.
  """

  dataflow: Dataflow = "direct"
  num_chunks: int = 1
  comm: Comm = "xla"
  compute: Compute = "xla"
  num_sms: int | None = None
  compute_granularity: Granularity | None = None
  reduce_in_epilogue: bool = False
  transport: Transport | None = None

  def __post_init__(self):
    if self.dataflow not in DATAFLOWS:
      raise ValueError(f"{self.dataflow=} must be one of {DATAFLOWS}.")
    if self.comm not in COMMS:
      raise ValueError(f"{self.comm=} must be one of {COMMS}.")
    if self.compute not in COMPUTES:
      raise ValueError(f"{self.compute=} must be one of {COMPUTES}.")
    for name in ("num_chunks", "num_sms"):
      v = getattr(self, name)
      if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
        # A NumPy integer (a shape entry, say) is that int: stored as one,
        # so that equal schedules hash equal.
        object.__setattr__(self, name, int(v))
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
        isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int)):
      raise TypeError(f"{self.num_sms=} must be None or a positive int.")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"{self.num_sms=} must be None or a positive int.")
    if (self.compute_granularity is not None
        and self.compute_granularity not in GRANULARITIES):
      raise ValueError(f"{self.compute_granularity=} must be None or one of"
                       f" {GRANULARITIES}.")
    if self.compute_granularity == "halving" and self.dataflow != "direct":
      # A ring step carries one piece: there is nothing to group.
      raise ValueError(
          "compute_granularity='halving' groups the peers of a direct step;"
          f" it needs dataflow='direct', got dataflow={self.dataflow!r}.")
    if self.compute_granularity == "flagged" and (
        self.dataflow != "direct" or self.comm != "dma"
        or self.reduce_in_epilogue):
      raise ValueError(
          "compute_granularity='flagged' needs dataflow='direct',"
          " comm='dma' and no reduce_in_epilogue (its pieces are signalled"
          " on the device), got"
          f" dataflow={self.dataflow!r}, comm={self.comm!r},"
          f" reduce_in_epilogue={self.reduce_in_epilogue}.")
    if not isinstance(self.reduce_in_epilogue, bool):
      raise TypeError(f"{self.reduce_in_epilogue=} must be a bool.")
    if self.reduce_in_epilogue and (self.dataflow != "direct"
                                    or self.compute != "pallas"):
      raise ValueError(
          f"reduce_in_epilogue=True needs dataflow='direct' and"
          f" compute='pallas' (the sum is added by ficco's kernel), got"
          f" dataflow={self.dataflow!r}, compute={self.compute!r}.")

    if self.transport is not None:
      if self.transport not in TRANSPORTS:
        raise ValueError(f"{self.transport=} must be None or one of"
                         f" {TRANSPORTS}.")
      if self.comm != "dma":
        raise ValueError(
            f"transport={self.transport!r} applies to comm='dma' only, got"
            f" comm={self.comm!r}; leave transport=None.")
      flagged = self.compute_granularity == "flagged"
      if self.transport == "push" and not flagged:
        raise ValueError(
            "transport='push' needs compute_granularity='flagged' (the"
            " push protocol carries the flagged kernel's pieces), got"
            f" compute_granularity={self.compute_granularity!r}.")
      if self.transport == "window" and flagged and self.compute != "pallas":
        raise ValueError(
            "compute_granularity='flagged' with compute='xla' (the push"
            " all-gather) travels by transport='push', not 'window'.")

  @property
  def overlapped(self) -> bool:
    return self.dataflow != "none"

  def granularity(self, op: str) -> str:
    """``compute_granularity`` with None resolved for ``op`` (see above)."""
    if self.compute_granularity is not None:
      return self.compute_granularity
    return self.default_granularity(op)

  def default_granularity(self, op: str) -> str:
    """What ``compute_granularity=None`` means for ``op`` (see above)."""
    if op == "all_gather_matmul" and self.compute == "xla":
      return "step"
    return "piece"

  def peer_groups(self, op: str, axis_size: int) -> tuple[int, ...]:
    """How many peers each dot of a direct step covers, in issue order.

    ``(1,) * (P - 1)`` for ``"piece"``, ``(P - 1,)`` for ``"step"`` and
    ``"flagged"`` (one launch covers every peer; flagged's copies still
    leave piece by piece, which the cost model's flagged branch models),
    `halving_groups` for ``"halving"``.
    """
    peers = axis_size - 1
    g = self.granularity(op)
    if g in ("step", "flagged"):
      return (peers,) if peers else ()
    if g == "halving":
      return halving_groups(peers)
    return (1,) * peers

  def resolved_transport(self, *, spans_processes: bool,
                         op: str | None = None) -> str | None:
    """The transport ``comm="dma"`` runs for ``op`` (None for
    ``comm="xla"``); see `resolve_transport`. The signalled all-gather
    (``op="all_gather_matmul"``, flagged, ``compute="pallas"``) runs the
    window transport; ``op=None`` answers for the reduce-scatter (a
    flagged schedule then pushes)."""
    if self.comm != "dma":
      return None
    if (op == "all_gather_matmul" and self.compute_granularity == "flagged"
        and self.compute == "pallas"):
      return self.transport or "window"
    return resolve_transport(
        self.transport, flagged=self.compute_granularity == "flagged",
        spans_processes=spans_processes)

  def short(self) -> str:
    """A compact label, e.g. ``direct/c4/dma/xla`` (`from_short` reads it)."""
    s = f"{self.dataflow}/c{self.num_chunks}/{self.comm}/{self.compute}"
    if self.num_sms is not None:
      s += f"/sm{self.num_sms}"
    if self.compute_granularity is not None:
      s += f"/{self.compute_granularity}"
    if self.reduce_in_epilogue:
      s += "/epi"
    if self.transport is not None:
      s += f"/{self.transport}"
    return s

  @classmethod
  def from_short(cls, label: str) -> "Schedule":
    """The schedule of a `short` label; ``dataflow/cN[/comm[/compute]]``
    then, in any order, ``smK``, a granularity, ``epi``
    (``reduce_in_epilogue``) and a transport.

    Raises:
      ValueError: ``label`` is not such a label.
    """
    if not isinstance(label, str):
      raise TypeError(f"label must be a str, got {label!r}.")
    parts = label.strip().split("/")
    kw: dict = {"dataflow": parts[0]}

    def put(field: str, value) -> None:
      # One token per field: a label that says two things is a typo.
      if field in kw:
        raise ValueError(f"it gives {field} twice")
      kw[field] = value

    try:
      if len(parts) > 1:
        if not parts[1].startswith("c"):
          raise ValueError("the second field must be cN")
        kw["num_chunks"] = int(parts[1][1:])
      if len(parts) > 2:
        kw["comm"] = parts[2]
      if len(parts) > 3:
        kw["compute"] = parts[3]
      for tok in parts[4:]:
        if tok in GRANULARITIES:
          put("compute_granularity", tok)
        elif tok == "epi":
          put("reduce_in_epilogue", True)
        elif tok in TRANSPORTS:
          put("transport", tok)
        elif tok.startswith("sm"):
          put("num_sms", int(tok[2:]))
        else:
          raise ValueError(f"unknown field {tok!r}")
      return cls(**kw)
    except (TypeError, ValueError) as e:
      raise ValueError(
          f"label={label!r} is not a schedule label"
          " (dataflow/cN[/comm[/compute[/smK][/piece|step|halving|flagged]"
          "[/epi][/rendezvous|window|push]]]):"
          f" {e}") from e


def resolve_transport(requested: str | None, *, flagged: bool,
                      spans_processes: bool) -> str:
  """The copy-engine transport an op runs.

  Args:
    requested: `Schedule.transport` (None: automatic).
    flagged: whether the op is the flagged reduce-scatter.
    spans_processes: whether the op's axis has devices in several processes
      (known when the op is lowered over a concrete mesh).

  Returns:
    ``"rendezvous"``, ``"window"`` or ``"push"``.

  Raises:
    ValueError: ``"rendezvous"`` over an axis that spans processes, which
      that transport cannot reach.
  """
  if requested == "rendezvous" and spans_processes:
    raise ValueError(
        "Schedule(transport='rendezvous') needs every device of the axis in"
        " this process, but the axis spans processes; use transport=None"
        " (automatic), 'window' (or 'push' for the flagged reduce-scatter),"
        " or comm='xla'.")
  if requested is not None:
    return requested
  if flagged:
    return "push"
  return "window" if spans_processes else "rendezvous"


def halving_groups(peers: int) -> tuple[int, ...]:
  """Group sizes of ``compute_granularity="halving"``: half of the peers
  (rounded up), then half of the rest, ..., down to one.

  The last group is one peer, so the own rows' dot, one piece long, hides
  its pull as it does piece by piece; every earlier group's pulls overlap
  all the dots after it. ``halving_groups(3) == (2, 1)``,
  ``halving_groups(7) == (4, 2, 1)``.
  """
  out = []
  while peers > 0:
    out.append((peers + 1) // 2)
    peers -= out[-1]
  return tuple(out)


NO_OVERLAP = Schedule(dataflow="none", num_chunks=1, comm="xla", compute="xla")
