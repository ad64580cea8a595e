"""psum_scatter(h @ w): partial products computed piecewise and reduced on the way.

Shapes after the scattered axis is moved first: ``h0 [P * m, *rest, F]`` (the
local columns of every row), ``w [F, N]``, result ``[m, *rest, N]`` (this
rank's rows of the sum over ranks).
"""

from __future__ import annotations

import math
import os

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import ag_matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src import vma


def _dot(a, w, st: ag_matmul.Static):
  return ag_matmul._dot(a, w, st)  # pylint: disable=protected-access


def _rows_dot(h0, start_of, size, w, st: ag_matmul.Static, **addends):
  """``h0[start:start + size] @ w``, ``start = start_of(rank)``: one partial
  product (`_pieces_dot`)."""
  return _pieces_dot(h0, lambda r: [start_of(r)], size, w, st, **addends)


def _pieces_dot(h0, starts_of, rows, w, st: ag_matmul.Static, *,
                addends=(), addend_rows=None, out=None, out_row=None,
                total_rows=None):
  """``h0[r:r + rows] @ w`` for each ``r`` in ``starts_of(rank)``, stacked,
  plus ``addends`` (rows ``addend_rows`` on, as `chunk_matmul_pieces`'s).

  With ``out_row`` (one piece, ``compute="pallas"``): the product is
  written at that row of ``out``, aliased, or of a fresh ``total_rows``-row
  array whose other rows are left unwritten (``out`` None).

  ``starts_of`` maps this device's rank along ``st.axis_name`` (a Python
  int, or the traced rank) to the first rows of the pieces. Taking it as a
  function lets ``compute="pallas"`` hand ficco's kernel every rank's rows
  as constants (`chunk_matmul.ByRank`): its only run-time operand is then
  the rank, which XLA computes once for all the op's launches.

  ``compute="pallas"`` runs ficco's kernel, which TMA-loads every piece's
  rows from ``h0`` in place, in one launch; XLA's dot needs them sliced out
  (and, for several pieces, copied together) first: a copy kernel per
  piece, ~4% of a 70B-class reduce-scatter on an H200.
  """
  rank = lax.axis_index(st.axis_name)
  if st.schedule.compute == "pallas":
    from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

    fold = math.prod(h0.shape[1:-1])
    table = [[r0 * fold for r0 in starts_of(r)] for r in range(st.axis_size)]
    place = {}
    if out_row is not None:
      place["out_rows"] = [out_row * fold]
      if out is None:
        place["fresh_rows"] = total_rows * fold
      else:
        total_rows = out.shape[0]
        place["out"] = out.reshape(-1, out.shape[-1])
    y = chunk_matmul.chunk_matmul_pieces(
        h0.reshape(-1, h0.shape[-1]), chunk_matmul.ByRank(rank, table),
        rows * fold, w, num_sms=st.schedule.num_sms,
        preferred_element_type=_out_dtype(h0, w, st),
        x_zero_padded_k=h0.shape[-1] != w.shape[0],
        addends=[a.reshape(-1, a.shape[-1]) for a in addends],
        addend_rows=(None if addend_rows is None
                     else [a0 * fold for a0 in addend_rows]),
        **place)
    lead = len(table[0]) * rows if out_row is None else total_rows
    return y.reshape((lead,) + h0.shape[1:-1] + (w.shape[1],))
  if addends or out_row is not None:
    raise ValueError("addends and out_row need compute='pallas' (Schedule"
                     " checks this).")
  starts = starts_of(rank)
  pieces = [lax.dynamic_slice_in_dim(h0, r, rows, axis=0) for r in starts]
  return _dot(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, 0),
              w, st)


def _send(x, axis_name, shift, p):
  # Rank i sends to rank (i + shift) % p.
  return lax.ppermute(x, axis_name, perm=[(i, (i + shift) % p) for i in range(p)])


def _ring(h0, w, st, m, row0, rows, direction):
  """Accumulate-and-forward ring over rows [row0, row0 + rows) of each block.

  At step t rank r adds its partial for block j_t and passes the sum on in
  ``direction``; the last step's block is r's own, so the sum lands home.
  """
  p = st.axis_size
  acc = None
  for step in range(p):
    part = _rows_dot(
        h0, lambda r, step=step: (r - direction * (1 + step)) % p * m + row0,
        rows, w, st)
    if acc is not None:
      received = _send(acc, st.axis_name, direction, p)
      acc_dtype = _acc_dtype(part.dtype)
      part = part.astype(acc_dtype) + received.astype(acc_dtype)
    acc = part.astype(_out_dtype(h0, w, st))
  return acc


def _acc_dtype(dtype):
  # Sums of partials run in at least float32 (float64 stays float64).
  return jnp.promote_types(dtype, jnp.float32)


def _out_dtype(h0, w, st):
  # h0 may carry pad_k's zero columns past w's rows (see forward).
  return ag_matmul.dot_dtype(
      jax.ShapeDtypeStruct(h0.shape[:-1] + w.shape[:1], h0.dtype), w, st)


def forward(h0: jax.Array, w: jax.Array, st: ag_matmul.Static) -> jax.Array:
  """``psum_scatter(h0 @ w, tiled)`` along the first axis, per ``st.schedule``."""
  p = st.axis_size
  schedule = st.schedule
  out_dtype = _out_dtype(h0, w, st)
  if not schedule.overlapped or p == 1:
    return lax.psum_scatter(_dot(h0, w, st), st.axis_name,
                            scatter_dimension=0, tiled=True).astype(out_dtype)
  m = h0.shape[0] // p
  if schedule.compute == "pallas":
    from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

    # Once per op, before the pieces: a K that leaves half a 64-deep step
    # over (qwen2-72b's 7392) gets zero columns, so the Hopper kernel runs
    # full-depth steps. Half-depth steps cost 20-25% of the matmul (H100,
    # benchmarks/results/h100_session8_b); the copy is all of h once (60 MB
    # at qwen2-72b M4096); end to end it measured level with XLA's dot
    # (benchmarks/RESULTS.md, session 8).
    h0 = chunk_matmul.pad_k(h0)
  if schedule.comm == "dma":
    return _forward_dma(h0, w, st, m)
  mc = m // schedule.num_chunks
  chunks = []
  for c in range(schedule.num_chunks):
    row0 = c * mc
    if schedule.dataflow == "direct":
      # Partials for peers first, so their transfers start while this rank
      # multiplies its own rows.
      received = []
      for shifts in _shift_groups(st):
        parts = _peers_dot(h0, w, st, m, row0, mc, shifts)
        for i, shift in enumerate(shifts):
          part = lax.slice_in_dim(parts, i * mc, (i + 1) * mc)
          received.append(_send(part, st.axis_name, shift, p))
      if schedule.reduce_in_epilogue:
        chunks.append(_rows_dot(h0, lambda r: r * m + row0, mc, w, st,
                                addends=received).astype(out_dtype))
        continue
      acc = _rows_dot(h0, lambda r: r * m + row0, mc, w, st)
      acc = acc.astype(_acc_dtype(acc.dtype))
      for r in received:
        acc = acc + r.astype(acc.dtype)
      chunks.append(acc.astype(out_dtype))
    elif schedule.dataflow == "ring":
      chunks.append(_ring(h0, w, st, m, row0, mc, +1))
    elif schedule.dataflow == "bidirectional":
      # Half of each piece's rows reduce around each direction, so both
      # directions of every link carry half of the bytes.
      half = mc // 2
      parts = []
      if half:
        parts.append(_ring(h0, w, st, m, row0, half, +1))
      parts.append(_ring(h0, w, st, m, row0 + half, mc - half, -1))
      chunks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0))
    else:
      raise ValueError(f"Unknown dataflow {schedule.dataflow!r}.")
  return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, 0)


# --------------------------------------------------------------------------
# comm="dma": partial products pulled by their owners on the copy engines.
# --------------------------------------------------------------------------


def _shift_groups(st: ag_matmul.Static) -> list[tuple[int, ...]]:
  """The direct dataflow's shifts ``1 .. P - 1`` (rank r's partial for rank
  r + s), cut into the schedule's peer groups: one dot and one hand-over
  per group (`Schedule.peer_groups`)."""
  out, s0 = [], 1
  for g in st.schedule.peer_groups(st.op_name, st.axis_size):
    out.append(tuple(range(s0, s0 + g)))
    s0 += g
  return out


def _peers_dot(h0, w, st: ag_matmul.Static, m, row0, rows, shifts):
  """One group's partials: rows ``[row0, row0 + rows)`` of the blocks of
  ranks ``r + s``, ``s`` in ``shifts``, times ``w``, stacked in that order
  (the blocks may wrap around this rank's own, so they need not be
  contiguous in ``h0``)."""
  p = st.axis_size
  return _pieces_dot(
      h0, lambda r: [(r + s) % p * m + row0 for s in shifts], rows, w, st)


def _group_plan(p: int, rows: int, shifts) -> plan_lib.GatherPlan:
  """Rank r pulls slot ``i`` of rank ``r - shifts[i]``'s group buffer.

  A group buffer holds one chunk's partials for ranks ``q + s``, ``s`` in
  ``shifts``, of its owner q, ``rows`` rows each, in that order, so the
  slot a puller reads depends only on the shift. One copy queue per shift:
  every device pulls from all the group's peers at once, as the
  all-gather's direct plan does. A one-shift group is a permutation: each
  device sends one piece and receives one, over one link (a ring hop's
  plan, with shift = its direction).
  """
  transfers = tuple(
      plan_lib.Transfer(dst=0, dst_row=i * rows, src_offset=(-s) % p,
                        src=0, src_row=i * rows, rows=rows, stream=i)
      for i, s in enumerate(shifts))
  return plan_lib.GatherPlan(axis_size=p, shard_rows=len(shifts) * rows,
                             landing_rows=(len(shifts) * rows,),
                             transfers=transfers, blocks=(),
                             num_streams=len(shifts))


def _dma(st):
  from ficco_jax._src.dma import peer_copy  # Loads the FFI library lazily.

  kw = dict(axis_name=st.axis_name, op_name=st.op_name,
            timeout_s=st.timeout_s)
  return peer_copy, kw


def _direct_dma(h0, w, st, m, mc, out_dtype):
  """Direct dataflow: each partial leaves as soon as it is multiplied.

  Step (j, s) multiplies chunk j of the rows owned by rank ``r + s`` and hands
  it to the copy engines; rank ``r + s`` pulls it while this rank multiplies
  the next step's partial. The compute stream never waits for a copy until
  the end: the own rows' matmul hides the last pull, then one fused pass adds
  the P - 1 pulled partials to it. Every step is a permutation (each device
  sends one piece and receives one), so no device's inbound links are shared.

  With ``compute_granularity="step"`` a chunk's partials for all peers are
  one dot and one start (every peer pulls its slot at once, on its own
  queue): ``num_chunks`` starts instead of ``num_chunks (P - 1)``, for ops
  whose host time shows, while each chunk's partials leave only once all of
  them are computed. ``"halving"`` sits between: one dot and one start per
  peer group (`Schedule.peer_groups`), whose pulls overlap the later
  groups' dots. XLA's dot reads a group's rows gathered into one operand (a
  copy of them per group); the Pallas kernel reads them in place.

  Live buffers until the end: the (P - 1) partials for peers and the (P - 1)
  landing buffers, ``2 (P - 1) m`` rows of the output row size, against the
  ``P m`` rows of the full partial that XLA's matmul + reduce_scatter holds
  (the same with either granularity).
  """
  if st.schedule.compute_granularity == "flagged":
    return _flagged_dma(h0, w, st, m, mc, out_dtype)
  peer_copy, kw = _dma(st)
  p = st.axis_size
  num_chunks = st.schedule.num_chunks
  groups = _shift_groups(st)
  plans = [_group_plan(p, mc, shifts) for shifts in groups]
  in_flight = []  # (chunk, part, landing, site) in issue order.

  def hand_over(j, part, plan):
    nonlocal h0
    site = peer_copy.new_site()
    landing = peer_copy.start([part], plan, site=site, **kw)[0]
    # The next matmul reads h0 through the barrier, so XLA cannot run it
    # before this start has handed the partial to the copy engines.
    h0, landing = lax.optimization_barrier((h0, landing))
    in_flight.append((j, part, landing, site))

  for j in range(num_chunks):
    for shifts, plan in zip(groups, plans):
      # One dot for the chunk's rows of the group's peers, one start for
      # all their pulls (a step's group is every peer: P - 1 times fewer
      # host rendezvous than piece by piece).
      part = _peers_dot(h0, w, st, m, j * mc, mc, shifts)
      hand_over(j, part.astype(out_dtype), plan)
  if st.schedule.reduce_in_epilogue:
    return _own_rows_with_pulls(h0, w, st, m, mc, in_flight)
  own = _rows_dot(h0, lambda r: r * m, m, w, st)
  # Wait only after the own rows' matmul was issued (it hides the last pull).
  landings = tuple(f[2] for f in in_flight)
  own, landings = lax.optimization_barrier((own, landings))
  # One call waits for every pulled partial and ends every invocation (the
  # partials for peers are free after it): on short ops each FFI call is
  # ~10 us of host time the device waits for. The price: the sum below also
  # waits until every peer has pulled this rank's partials, not only for
  # this rank's own pulls.
  pulled = peer_copy.sync([(buf, f[3]) for buf, f in zip(landings, in_flight)],
                          [([f[1]], f[3]) for f in in_flight], **kw)
  # A group's landing buffer holds one slot per peer of the group.
  slots = [(f[0], buf[slot * mc:(slot + 1) * mc])
           for f, buf in zip(in_flight, pulled)
           for slot in range(buf.shape[0] // mc)]
  return _add_pulled(own, slots, num_chunks, mc, out_dtype)


def _flagged_dma(h0, w, st, m, mc, out_dtype):
  """The direct dataflow with ``compute_granularity="flagged"``.

  One kernel computes, in order, chunk j's partial for each peer ``r + s``
  (``s = 1 .. P - 1``), for every chunk, then this rank's own rows; it
  bumps piece i's flag as it stores piece i. One start hands every pull to
  the copy engines: rank r pulls slot i of rank ``r - s_i``, once that
  rank's flag i reaches the target, so a partial leaves as soon as it is
  written, as with ``"piece"``, for one kernel launch and one start per op.
  ``arm`` runs first: it zeroes the flags and returns the landing buffers,
  free from that point on, so pulls may land while the kernel still runs,
  and this device's rank, which the kernel reads for its piece offsets
  (no partition-id in the program).

  Live buffers: the ``P m`` rows of every partial and own row (one kernel
  result) and the ``(P - 1) m`` landing rows, as ``"piece"``'s ``2 (P - 1)
  m`` plus the own rows.
  """
  peer_copy, kw = _dma(st)
  p = st.axis_size
  num_chunks = st.schedule.num_chunks
  shifts = range(1, p)
  # Piece order: chunk-major peers' partials, then the own rows (chunked
  # alike, so every piece has mc rows and no tile straddles two).
  slots = [(j, s) for j in range(num_chunks) for s in shifts]
  table = tuple(
      tuple((r + s) % p * m + j * mc for j, s in slots)
      + tuple(r * m + j * mc for j in range(num_chunks))
      for r in range(p))
  if _flagged_transport() == "push":
    if os.environ.get("FICCO_FLAGGED_RANK"):
      # Not ignored in silence: the push arm always writes the rank.
      raise ValueError(
          "FICCO_FLAGGED_RANK is a switch of the rendezvous transport; set"
          " FICCO_FLAGGED_TRANSPORT=rendezvous with it, or unset it.")
    return _flagged_push(h0, w, st, mc, out_dtype, slots, table)
  # Every pull on one copy queue, in piece order: the pieces complete one
  # after another, and the P - 1 sources share this device's inbound links
  # (~400 GB/s from three peers against ~384 from one on 4xH200), so
  # parallel queues would not land them sooner; one queue spares the issuer
  # P - 2 CUDA calls per op (each queue first waits for the arm's event),
  # and that issue is on a host-bound op's critical path.
  plan = plan_lib.GatherPlan(
      axis_size=p, shard_rows=len(table[0]) * mc,
      landing_rows=(len(slots) * mc,),
      transfers=tuple(
          plan_lib.Transfer(dst=0, dst_row=i * mc, src_offset=(-s) % p,
                            src=0, src_row=i * mc, rows=mc, stream=0)
          for i, (_, s) in enumerate(slots)),
      blocks=(), num_streams=1)
  site = peer_copy.new_site()
  flags, rank, landings = peer_copy.arm(
      h0, len(table[0]), plan, site=site,
      dtype=out_dtype, row_shape=(w.shape[1],), **_arm_kw(kw))
  if _flagged_rank_source() == "axis_index":
    # Measurement switch: the rank from XLA's partition-id, as before
    # session 19 (two more steps of the program per call; the arm still
    # writes its rank, unused).
    rank = lax.axis_index(st.axis_name)
  parts, flags, target = _flagged_kernel(h0, w, st, mc, out_dtype, flags,
                                         rank, table)
  landing = peer_copy.start(
      [parts], plan, site=site, flags=flags, landings=landings,
      flag_target=target, src_flags=tuple(range(len(slots))), **kw)[0]
  (pulled,) = peer_copy.sync([(landing, site)], [([parts, flags], site)],
                             **kw)
  own0 = len(slots) * mc
  return _add_pulled(parts[own0:own0 + num_chunks * mc],
                     [(j, pulled[i * mc:(i + 1) * mc])
                      for i, (j, _) in enumerate(slots)],
                     num_chunks, mc, out_dtype)


def _flagged_kernel(h0, w, st, mc, out_dtype, flags, rank, table):
  """The flagged kernel of either transport: every piece of ``table``'s
  rows for this ``rank``, bumping ``flags`` in place; returns (parts typed
  varying as its inputs, flags, the flags' target)."""
  from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

  parts, flags, target = chunk_matmul.chunk_matmul_flagged(
      h0, chunk_matmul.ByRank(rank, table), mc, w, flags,
      num_sms=st.schedule.num_sms, preferred_element_type=out_dtype,
      x_zero_padded_k=h0.shape[1] != w.shape[0])
  return vma.vary_like(parts, h0, w), flags, target


def _flagged_push(h0, w, st, mc, out_dtype, slots, table):
  """`_flagged_dma` over the push protocol (xla_ffi/WINDOWS.md, "Push").

  The same kernel and pieces, but each rank's copy engines push its piece
  for rank ``r + s`` into that rank's window (two landing halves, so a
  push waits only for the call before last to be read), and the finish adds
  the landed pieces to the own rows with a kernel of its own: arm, kernel,
  start and finish per call, no host wait for peers, no XLA sum after a
  sync. Memory: a pooled window's two halves of ``(P - 1) m`` rows per
  device (xla_ffi/WINDOWS.md, "Push"), instead of the landing buffers.
  """
  from ficco_jax._src.dma import push  # Loads the FFI library lazily.

  peer_copy, kw = _dma(st)
  kw["site"] = peer_copy.new_site()
  num_chunks = st.schedule.num_chunks
  row_bytes = w.shape[1] * jnp.dtype(out_dtype).itemsize
  half = push.half_bytes(len(slots) * mc, row_bytes)
  flags, rank = push.arm(h0, len(table[0]), half, **_arm_kw(kw))
  parts, flags, target = _flagged_kernel(h0, w, st, mc, out_dtype, flags,
                                         rank, table)
  # Piece i (chunk j, shift s) goes to rank r + s, at the row where that
  # rank's finish expects chunk j's piece from rank (r + s) - s.
  pieces = [(s, i * mc, i * mc, mc, i) for i, (_, s) in enumerate(slots)]
  flags = push.start(parts, flags, pieces, flag_target=target, half=half,
                     **kw)
  return push.finish(parts, flags, own_row=len(slots) * mc, chunk_rows=mc,
                     num_chunks=num_chunks, half=half, **kw)


def _switch(var: str, default: str, other: str) -> str:
  """The value of measurement switch ``var``: ``default`` when unset, else
  ``default`` or ``other``; anything else is a ValueError naming it."""
  choice = os.environ.get(var) or default
  if choice not in (default, other):
    raise ValueError(f"{var}={choice!r} must be {default!r} (the default)"
                     f" or {other!r}.")
  return choice


def _flagged_transport() -> str:
  """FICCO_FLAGGED_TRANSPORT: how the flagged pieces travel, "push" (pushes
  into the owners' windows, no host rendezvous; the default) or "rendezvous"
  (pulls after a host rendezvous per call; one process only, where every
  device of the axis is). Push became the default in session 22: on 4 H200s
  it cut the host floor of a call from 0.211 to 0.180 ms and lifted the
  host-bound llama3-8b M4096 from 1.01-1.16x to 1.18-1.38x over XLA
  (benchmarks/RESULTS.md, "Session 22")."""
  return _switch("FICCO_FLAGGED_TRANSPORT", "push", "rendezvous")


def _add_pulled(own, pulled, num_chunks, mc, out_dtype):
  """This rank's result: chunk j's own rows ``own[j mc:(j + 1) mc]`` plus
  every pulled ``[mc, n]`` partial ``(j, rows)`` of chunk j, in the order
  given, accumulated in f32 (or wider) and rounded once."""
  acc_dtype = _acc_dtype(own.dtype)
  chunks = []
  for j in range(num_chunks):
    acc = own[j * mc:(j + 1) * mc].astype(acc_dtype)
    for jj, rows in pulled:
      if jj == j:
        acc = acc + rows.astype(acc_dtype)
    chunks.append(acc.astype(out_dtype))
  return chunks[0] if num_chunks == 1 else jnp.concatenate(chunks, 0)


def _flagged_rank_source() -> str:
  """FICCO_FLAGGED_RANK: where the flagged kernel's rank comes from, "arm"
  (unset: the default) or "axis_index" (for measurements)."""
  return _switch("FICCO_FLAGGED_RANK", "arm", "axis_index")


def _arm_kw(kw):
  return {k: v for k, v in kw.items() if k != "timeout_s"}


def _own_rows_with_pulls(h0, w, st, m, mc, in_flight):
  """The direct dataflow's end with ``reduce_in_epilogue``: chunk j's own
  rows multiplied by a kernel that adds chunk j's pulled partials.

  Chunk j's kernel waits for chunk j's pulls only, and is issued before the
  wait for chunk j + 1's, so it hides them (a sync per chunk, against one
  for the whole op without the epilogue). The last sync also ends every
  invocation: by symmetry the peers' pulls of this rank's last partial
  finish when this rank's own last pull does.
  """
  peer_copy, kw = _dma(st)
  num_chunks = st.schedule.num_chunks
  ends = [([f[1]], f[3]) for f in in_flight]
  out = None  # The result, written chunk by chunk in place.
  for j in range(num_chunks):
    mine = [f for f in in_flight if f[0] == j]
    landings = tuple(f[2] for f in mine)
    # After every start (h0 went through each start's barrier) and, from
    # chunk 1 on, after the previous chunk's kernel: else XLA may wait for
    # these pulls before work that hides them.
    if out is None:
      _, landings = lax.optimization_barrier((h0, landings))
    else:
      out, landings = lax.optimization_barrier((out, landings))
    last = j == num_chunks - 1
    pulled = peer_copy.sync([(b, f[3]) for b, f in zip(landings, mine)],
                            ends if last else [], **kw)
    # A group's landing buffer holds one partial per peer, mc rows each.
    addends = [buf for buf in pulled for _ in range(buf.shape[0] // mc)]
    rows = [slot * mc for buf in pulled for slot in range(buf.shape[0] // mc)]
    # Each chunk's kernel writes its rows of one [m] result in place (a
    # concatenate would be one more pass over the result).
    out = _rows_dot(h0, lambda r, j=j: r * m + j * mc, mc, w, st,
                    addends=addends, addend_rows=rows, out=out,
                    out_row=j * mc, total_rows=m)
  # Written in place chunk by chunk, the result is typed invariant (see
  # _mgpu_into's fresh_rows); it varies as h0 and w do.
  return vma.vary_like(out, h0, w)


def _ring_dma(h0, w, st, m, row0, rows, direction, out_dtype, ends):
  """Accumulate-and-forward ring; each hop is one copy-engine pull.

  While the running sum of step t travels to the next rank, this rank
  multiplies its partial for step t + 1. Each hop's sent sum must outlive
  the neighbour's read: it is appended to ``ends`` (keepalive, site), which
  the caller ends in one call after the whole op. So every sent sum of every
  chunk and direction stays live until then: ``(P - 1) m`` rows per op (m:
  this rank's output rows), plus the sum being received, against ``P m``
  for XLA's full partial product.
  """
  peer_copy, kw = _dma(st)
  p = st.axis_size
  # Rank r pulls the running sum of rank r - direction: a one-peer group.
  gplan = _group_plan(p, rows, (direction,))
  # Rank r's block at `step`; r is an int or the traced rank (_pieces_dot).
  row_of = lambda step: (
      lambda r: (r - direction * (1 + step)) % p * m + row0)
  acc = _rows_dot(h0, row_of(0), rows, w, st).astype(out_dtype)
  for step in range(1, p):
    site = peer_copy.new_site()
    landing = peer_copy.start([acc], gplan, site=site, **kw)[0]
    h0, landing = lax.optimization_barrier((h0, landing))
    part = _rows_dot(h0, row_of(step), rows, w, st)
    part, landing = lax.optimization_barrier((part, landing))
    received = peer_copy.wait(landing, site=site, **kw)
    acc_dtype = _acc_dtype(part.dtype)
    ends.append(([acc], site))
    acc = (part.astype(acc_dtype) + received.astype(acc_dtype)).astype(out_dtype)
  return acc


def _forward_dma(h0, w, st, m):
  schedule = st.schedule
  mc = m // schedule.num_chunks
  out_dtype = _out_dtype(h0, w, st)
  if schedule.dataflow == "direct":
    return _direct_dma(h0, w, st, m, mc, out_dtype)
  ends = []  # (keepalive, site) of every ring hop, ended together below.
  chunks = []
  for c in range(schedule.num_chunks):
    row0 = c * mc
    if schedule.dataflow == "ring":
      chunks.append(_ring_dma(h0, w, st, m, row0, mc, +1, out_dtype,
                              ends))
      continue
    half = mc // 2
    parts = []
    if half:
      parts.append(_ring_dma(h0, w, st, m, row0, half, +1, out_dtype,
                             ends))
    parts.append(_ring_dma(h0, w, st, m, row0 + half, mc - half, -1,
                           out_dtype, ends))
    chunks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0))
  out = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, 0)
  peer_copy, kw = _dma(st)
  return peer_copy.sync([], ends, out=out, **kw)[0]
