"""The reduce-scatter's flagged granularity: one kernel that signals each
piece as it stores it, and copies that wait for those signals on the device.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ficco_jax._src import plan as plan_lib
from ficco_jax._src import vma
from ficco_jax._src.matmul import Static
from ficco_jax._src.ops.matmul_reduce_scatter import pieces


def forward(h0, w, st: Static, m, mc, out_dtype):
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

  The pieces travel over the push protocol (`_push`; the default) or the
  rendezvous transport (``Schedule(transport="rendezvous")``, one process
  only), whose live buffers are the ``P m`` rows of every partial and own
  row (one kernel result) and the ``(P - 1) m`` landing rows, as
  ``"piece"``'s ``2 (P - 1) m`` plus the own rows.
  """
  if h0.ndim > 2:
    # The kernel takes 2-D operands: fold the middle dims into rows. Each
    # piece is a block of whole leading rows, so it stays contiguous.
    rest = h0.shape[1:-1]
    fold = math.prod(rest)
    out = forward(h0.reshape(-1, h0.shape[-1]), w, st, m * fold, mc * fold,
                  out_dtype)
    return out.reshape((m,) + rest + (w.shape[1],))
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
  if st.schedule.transport in (None, "push"):
    return _push(h0, w, st, mc, out_dtype, slots, table)
  return _rendezvous(h0, w, st, mc, out_dtype, slots, table)


def _rendezvous(h0, w, st: Static, mc, out_dtype, slots, table):
  """`forward` over the rendezvous transport: one start pulls every piece
  once its source rank's flag says it is written."""
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  kw = st.copy_kwargs()
  p = st.axis_size
  num_chunks = st.schedule.num_chunks
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
      dtype=out_dtype, row_shape=(w.shape[1],), **_arm_kwargs(kw))
  parts, flags, target = _kernel(h0, w, st, mc, out_dtype, flags, rank,
                                 table)
  landing = peer_copy.start(
      [parts], plan, site=site, flags=flags, landings=landings,
      flag_target=target, src_flags=tuple(range(len(slots))), **kw)[0]
  (pulled,) = peer_copy.sync([(landing, site)], [([parts, flags], site)],
                             **kw)
  own0 = len(slots) * mc
  return pieces.add_pulled(parts[own0:own0 + num_chunks * mc],
                           [(j, pulled[i * mc:(i + 1) * mc])
                            for i, (j, _) in enumerate(slots)],
                           num_chunks, mc, out_dtype)


def _kernel(h0, w, st: Static, mc, out_dtype, flags, rank, table):
  """The flagged kernel of either transport: every piece of ``table``'s
  rows for this ``rank``, bumping ``flags`` in place; returns (parts typed
  varying as its inputs, flags, the flags' target)."""
  from ficco_jax._src.pallas import chunk_matmul  # pylint: disable=g-import-not-at-top

  parts, flags, target = chunk_matmul.chunk_matmul_flagged(
      h0, chunk_matmul.ByRank(rank, table), mc, w, flags,
      num_sms=st.schedule.num_sms, preferred_element_type=out_dtype,
      x_zero_padded_k=h0.shape[1] != w.shape[0])
  return vma.vary_like(parts, h0, w), flags, target


def _push(h0, w, st: Static, mc, out_dtype, slots, table):
  """`forward` over the push protocol (docs/windows.md, "Push").

  The same kernel and pieces, but each rank's copy engines push its piece
  for rank ``r + s`` into that rank's window (two landing halves, so a
  push waits only for the call before last to be read), and the finish adds
  the landed pieces to the own rows with a kernel of its own: arm, kernel,
  start and finish per call, no host wait for peers, no XLA sum after a
  sync. Memory: a pooled window's two halves of ``(P - 1) m`` rows per
  device (docs/windows.md, "Push"), instead of the landing buffers.
  """
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.dma import push  # pylint: disable=g-import-not-at-top

  kw = st.copy_kwargs()
  del kw["transport"]  # The push protocol is its own transport.
  kw["site"] = peer_copy.new_site()
  num_chunks = st.schedule.num_chunks
  row_bytes = w.shape[1] * jnp.dtype(out_dtype).itemsize
  half = push.half_bytes(len(slots) * mc, row_bytes)
  flags, rank = push.arm(h0, len(table[0]), half, **_arm_kwargs(kw))
  parts, flags, target = _kernel(h0, w, st, mc, out_dtype, flags, rank,
                                 table)
  # Piece i (chunk j, shift s) goes to rank r + s, at the row where that
  # rank's finish expects chunk j's piece from rank (r + s) - s.
  moves = [(s, i * mc, i * mc, mc, i) for i, (_, s) in enumerate(slots)]
  flags = push.start(parts, flags, moves, flag_target=target, half=half,
                     **kw)
  return push.finish(parts, flags, own_row=len(slots) * mc, chunk_rows=mc,
                     num_chunks=num_chunks, half=half, **kw)


def _arm_kwargs(kw):
  # An arm waits for nothing, so it takes no timeout.
  return {k: v for k, v in kw.items() if k != "timeout_s"}
