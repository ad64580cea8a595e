"""psum_scatter(h @ w): partial products computed piecewise and reduced on the way.

Shapes after the scattered axis is moved first: ``h0 [P * m, *rest, F]`` (the
local columns of every row), ``w [F, N]``, result ``[m, *rest, N]`` (this
rank's rows of the sum over ranks).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import ag_matmul
from ficco_jax._src import plan as plan_lib


def _dot(a, w, st: ag_matmul.Static):
  """One partial product; ``compute="pallas"`` runs it through ficco's kernel."""
  if st.schedule.compute == "pallas" and st.schedule.overlapped:
    from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

    out_dtype = ag_matmul.dot_dtype(a, w, st)
    y = chunk_matmul.chunk_matmul(a.reshape(-1, a.shape[-1]), w,
                                  num_sms=st.schedule.num_sms,
                                  preferred_element_type=out_dtype)
    return y.reshape(a.shape[:-1] + (w.shape[1],))
  return ag_matmul._dot(a, w, st)  # pylint: disable=protected-access


def _rows(h0, start, size):
  return lax.dynamic_slice_in_dim(h0, start, size, axis=0)


def _send(x, axis_name, shift, p):
  # Rank i sends to rank (i + shift) % p.
  return lax.ppermute(x, axis_name, perm=[(i, (i + shift) % p) for i in range(p)])


def _ring(h0, w, st, rank, m, row0, rows, direction):
  """Accumulate-and-forward ring over rows [row0, row0 + rows) of each block.

  At step t rank r adds its partial for block j_t and passes the sum on in
  ``direction``; the last step's block is r's own, so the sum lands home.
  """
  p = st.axis_size
  acc = None
  for step in range(p):
    block = (rank - direction * (1 + step)) % p
    part = _dot(_rows(h0, block * m + row0, rows), w, st)
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
  return ag_matmul.dot_dtype(h0, w, st)


def forward(h0: jax.Array, w: jax.Array, st: ag_matmul.Static) -> jax.Array:
  """``psum_scatter(h0 @ w, tiled)`` along the first axis, per ``st.schedule``."""
  p = st.axis_size
  schedule = st.schedule
  out_dtype = _out_dtype(h0, w, st)
  if not schedule.overlapped or p == 1:
    return lax.psum_scatter(_dot(h0, w, st), st.axis_name,
                            scatter_dimension=0, tiled=True).astype(out_dtype)
  m = h0.shape[0] // p
  if schedule.comm == "dma":
    return _forward_dma(h0, w, st, m)
  mc = m // schedule.num_chunks
  rank = lax.axis_index(st.axis_name)
  chunks = []
  for c in range(schedule.num_chunks):
    row0 = c * mc
    if schedule.dataflow == "direct":
      # Partials for peers first, so their transfers start while this rank
      # multiplies its own rows.
      received = []
      for shift in range(1, p):
        dest = (rank + shift) % p
        part = _dot(_rows(h0, dest * m + row0, mc), w, st)
        received.append(_send(part, st.axis_name, shift, p))
      acc = _dot(_rows(h0, rank * m + row0, mc), w, st)
      acc = acc.astype(_acc_dtype(acc.dtype))
      for r in received:
        acc = acc + r.astype(acc.dtype)
      chunks.append(acc.astype(out_dtype))
    elif schedule.dataflow == "ring":
      chunks.append(_ring(h0, w, st, rank, m, row0, mc, +1))
    elif schedule.dataflow == "bidirectional":
      # Half of each piece's rows reduce around each direction, so both
      # directions of every link carry half of the bytes.
      half = mc // 2
      parts = []
      if half:
        parts.append(_ring(h0, w, st, rank, m, row0, half, +1))
      parts.append(_ring(h0, w, st, rank, m, row0 + half, mc - half, -1))
      chunks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0))
    else:
      raise ValueError(f"Unknown dataflow {schedule.dataflow!r}.")
  return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, 0)


# --------------------------------------------------------------------------
# comm="dma": partial products pulled by their owners on the copy engines.
# --------------------------------------------------------------------------


def _direct_plan(p: int, rows: int) -> plan_lib.GatherPlan:
  """Rank r pulls, from every peer r - s, that peer's partial for r's rows.

  Peer q's source operand s - 1 is its partial for rank q + s; they all land
  in one buffer so one reduction consumes them, one copy queue per peer.
  """
  transfers = tuple(
      plan_lib.Transfer(dst=0, dst_row=k * rows, src_offset=(p - s) % p,
                        src=s - 1, src_row=0, rows=rows, stream=k)
      for k, s in enumerate(range(1, p)))
  return plan_lib.GatherPlan(axis_size=p, shard_rows=rows,
                             landing_rows=((p - 1) * rows,),
                             transfers=transfers, blocks=(),
                             num_streams=max(p - 1, 1))


def _neighbour_plan(p: int, rows: int, direction: int) -> plan_lib.GatherPlan:
  """Rank r pulls the running sum of rank r - direction."""
  transfer = plan_lib.Transfer(dst=0, dst_row=0, src_offset=(-direction) % p,
                               src=0, src_row=0, rows=rows, stream=0)
  return plan_lib.GatherPlan(axis_size=p, shard_rows=rows, landing_rows=(rows,),
                             transfers=(transfer,), blocks=(), num_streams=1)


def _dma(st):
  from ficco_jax._src.dma import peer_copy  # Loads the FFI library lazily.

  kw = dict(axis_name=st.axis_name, op_name=st.op_name,
            timeout_s=st.timeout_s)
  return peer_copy, kw


def _direct_dma(h0, w, st, rank, m, mc, out_dtype):
  """Direct dataflow: every rank's partials for a chunk go out at once.

  Chunk c's partials for the P - 1 peers are multiplied, then handed to the
  copy engines; while the peers pull them, this rank multiplies chunk c + 1.
  Its own partial and the reduction of what it pulled come one chunk later.
  Live partial buffers: at most two chunks' worth, 2 (P - 1) mc rows.
  """
  peer_copy, kw = _dma(st)
  p = st.axis_size
  gplan = _direct_plan(p, mc)
  num_chunks = st.schedule.num_chunks

  def issue(c, h0):
    parts = [_dot(_rows(h0, ((rank + s) % p) * m + c * mc, mc), w, st)
             .astype(out_dtype) for s in range(1, p)]
    site = peer_copy.new_site()
    landing = peer_copy.start(parts, gplan, site=site, **kw)[0]
    return parts, landing, site

  def reduce(c, h0, parts, landing, site):
    # The matmul of the own rows hides the tail of this chunk's copies; tie
    # its input to the start, or XLA may run it first (nothing else orders
    # the last chunk's) and leave the copies exposed.
    h0, landing = lax.optimization_barrier((h0, landing))
    own = _dot(_rows(h0, rank * m + c * mc, mc), w, st)
    own, landing = lax.optimization_barrier((own, landing))
    pulled = peer_copy.wait(landing, site=site, **kw)
    acc_dtype = _acc_dtype(own.dtype)
    pulled = pulled.reshape((p - 1, mc) + pulled.shape[1:]).astype(acc_dtype)
    out = (own.astype(acc_dtype) + pulled.sum(axis=0)).astype(out_dtype)
    return peer_copy.done(out, parts, site=site, **kw)

  chunks, in_flight = [], [issue(0, h0)]
  for c in range(num_chunks):
    if c + 1 < num_chunks:
      # Issue chunk c + 1 before reducing chunk c: its copies then overlap the
      # own-rows matmul and the reduction of chunk c.
      # The landing buffer is threaded through the barrier, never forked: a
      # second consumer of a buffer the copy engine is still filling would
      # let XLA copy it before it is complete.
      parts, landing, site = in_flight[-1]
      h0, landing = lax.optimization_barrier((h0, landing))
      in_flight[-1] = (parts, landing, site)
      in_flight.append(issue(c + 1, h0))
    parts, landing, site = in_flight[c]
    out_c = reduce(c, h0, parts, landing, site)
    # The next issue waits for this chunk's done, which bounds the live
    # partial buffers to two chunks.
    h0, out_c = lax.optimization_barrier((h0, out_c))
    chunks.append(out_c)
  return chunks


def _ring_dma(h0, w, st, rank, m, row0, rows, direction, out_dtype):
  """Accumulate-and-forward ring; each hop is one copy-engine pull.

  While the running sum of step t travels to the next rank, this rank
  multiplies its partial for step t + 1. Live buffers: the running sum being
  read by the neighbour and the one being received, ``2 * rows`` rows.
  """
  peer_copy, kw = _dma(st)
  p = st.axis_size
  gplan = _neighbour_plan(p, rows, direction)
  block = lambda step: (rank - direction * (1 + step)) % p
  acc = _dot(_rows(h0, block(0) * m + row0, rows), w, st).astype(out_dtype)
  for step in range(1, p):
    site = peer_copy.new_site()
    landing = peer_copy.start([acc], gplan, site=site, **kw)[0]
    h0, landing = lax.optimization_barrier((h0, landing))
    part = _dot(_rows(h0, block(step) * m + row0, rows), w, st)
    part, landing = lax.optimization_barrier((part, landing))
    received = peer_copy.wait(landing, site=site, **kw)
    acc_dtype = _acc_dtype(part.dtype)
    new = (part.astype(acc_dtype) + received.astype(acc_dtype)).astype(out_dtype)
    acc = peer_copy.done(new, [acc], site=site, **kw)
  return acc


def _forward_dma(h0, w, st, m):
  schedule = st.schedule
  rank = lax.axis_index(st.axis_name)
  mc = m // schedule.num_chunks
  out_dtype = _out_dtype(h0, w, st)
  if schedule.dataflow == "direct":
    chunks = _direct_dma(h0, w, st, rank, m, mc, out_dtype)
  else:
    chunks = []
    for c in range(schedule.num_chunks):
      row0 = c * mc
      if schedule.dataflow == "ring":
        chunks.append(_ring_dma(h0, w, st, rank, m, row0, mc, +1, out_dtype))
        continue
      half = mc // 2
      parts = []
      if half:
        parts.append(_ring_dma(h0, w, st, rank, m, row0, half, +1, out_dtype))
      parts.append(_ring_dma(h0, w, st, rank, m, row0 + half, mc - half, -1,
                             out_dtype))
      chunks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, 0))
  return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, 0)
