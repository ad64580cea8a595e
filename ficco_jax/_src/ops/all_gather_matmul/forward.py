"""all_gather(x) @ w, piece by piece as the gather engine lands the pieces.

Shapes follow the public op after the gathered axis is moved first:
``x0 [m, *rest, K]`` (the local shard), ``w [K, n]``, result
``[P * m, *rest, n]`` in rank order along the first axis.

No zero-filled result is updated piece by piece: that costs a write of the
whole output plus a copy of every piece. With ``compute="pallas"`` the
first kernel creates the result (its other rows unwritten) and each later
one writes its rows in place: every row is written once. With
``compute="xla"`` each piece's dot has its own buffer and the assembly
happens once, at the end: the products in shift order (block ``s`` holds
rank ``r + s``'s rows, a layout every rank shares statically), rolled by
``r m`` rows into rank order (a concatenation and a dynamic slice, which
XLA may fuse).
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src import gather
from ficco_jax._src import matmul
from ficco_jax._src import plan as plan_lib
from ficco_jax._src import vma
from ficco_jax._src.matmul import Static


def _pallas_write(out, data, x_rows, rows, w, out_rows, total, dtype,
                  st: Static, landed=None):
  """Pieces ``data[x_rows[i] : + rows] @ w`` written at ``out_rows[i]`` of
  ``out`` in one launch, on the 2-D views (``rest`` folds into rows); with
  ``out=None`` into a fresh ``[total, *rest, n]`` result of ``dtype`` whose
  other rows are left for later calls. ``landed``: ``(flags, index)``, the
  kernel waits for piece ``i``'s flag (`chunk_matmul_pieces`)."""
  from ficco_jax._src.pallas import chunk_matmul  # Optional dependency.

  fold = math.prod(data.shape[1:-1])
  kw = {"preferred_element_type": dtype}
  if out is None:
    kw["fresh_rows"] = total * fold
  else:
    kw["out"] = out.reshape(-1, out.shape[-1])
  y = chunk_matmul.chunk_matmul_pieces(
      data.reshape(-1, data.shape[-1]), [r * fold for r in x_rows],
      rows * fold, w, out_rows=[r * fold for r in out_rows],
      num_sms=st.schedule.num_sms, landed=landed, **kw)
  return y.reshape((total,) + data.shape[1:-1] + (w.shape[1],))


def _assemble(products, shift_rows, rank, m: int, p: int):
  """The result in rank order from products placed in shift order."""
  order = sorted(range(len(products)), key=shift_rows.__getitem__)
  row = 0
  for i in order:
    if shift_rows[i] != row:
      raise AssertionError(f"pieces leave a gap at shift row {row}:"
                           f" {sorted(shift_rows)}")
    row += products[i].shape[0]
  if row != p * m:
    raise AssertionError(f"pieces cover {row} of {p * m} rows")
  by_shift = jnp.concatenate([products[i] for i in order], axis=0)
  # Row j of rank order holds shift row (j - r m) mod P m.
  return jnp.roll(by_shift, rank * m, axis=0)


def forward(x0: jax.Array, w: jax.Array, st: Static) -> jax.Array:
  """``all_gather(x0, tiled) @ w`` with the schedule in ``st``."""
  return _run(x0, w, st, keep_gathered=False)[0]


def forward_and_gathered(x0: jax.Array, w: jax.Array, st: Static
                         ) -> tuple[jax.Array, jax.Array | None]:
  """``(all_gather(x0) @ w, all_gather(x0))`` from one gather, the product
  overlapped as in `forward`; the gathered operand is assembled from the
  pieces as they landed (one copy; the push all-gather's copy engines copy
  each out of its window as it lands).

  The gradients take both: an all-gather matmul keeps the gathered ``x``
  for its ``dw`` (as XLA's own autodiff of all_gather + dot does), and the
  reduce-scatter's gradient contracts ``h`` with the gathered cotangent of
  its ``dh``, so nothing travels twice.
  """
  return _run(x0, w, st, keep_gathered=True)


def _run(x0, w, st: Static, *, keep_gathered: bool):
  p, m = st.axis_size, x0.shape[0]
  out_dtype = matmul.dot_dtype(x0, w, st)
  if not st.schedule.overlapped or p == 1:
    gathered = lax.all_gather(x0, st.axis_name, axis=0, tiled=True)
    return (matmul.dot(gathered, w, st).astype(out_dtype),
            gathered if keep_gathered else None)

  if st.schedule.compute_granularity == "flagged":
    if st.schedule.compute == "pallas":
      return _signalled(x0, w, st, out_dtype, keep_gathered)
    return _push(x0, w, st, out_dtype, keep_gathered)

  if st.schedule.comm == "dma":
    # The copies start from x0 but belong to the whole product: tied to w
    # too, a loop-invariant x0 under lax.scan cannot take the start out of
    # the loop while the waits, which depend on w, stay in it.
    x0, w = lax.optimization_barrier((x0, w))
  rank = lax.axis_index(st.axis_name)
  gplan = plan_lib.gather_plan(st.schedule, axis_size=p, shard_rows=m)
  step = st.schedule.granularity(st.op_name) == "step"

  if st.schedule.compute == "pallas":
    shift_rows: list[int] = []  # Static, in the order of the kept pieces.

    def consume(carry, data, blocks):
      out, pieces = carry
      if keep_gathered:
        pieces += tuple(gather.block_rows(data, b) for b in blocks)
        shift_rows.extend(gather.shift_row(b, p, m) for b in blocks)
      dest = [gather.owner_rank(b, rank, p) * m + b.owner_row for b in blocks]
      if step and len(blocks) > 1:
        rows = {b.rows for b in blocks}
        if len(rows) != 1:
          raise ValueError(
              "compute_granularity='step' with compute='pallas' needs the"
              f" blocks of a step to have equal rows, got {sorted(rows)}.")
        # One launch writes every block at its owner's rows (in place).
        return _pallas_write(out, data, [b.landing_row for b in blocks],
                             rows.pop(), w, dest, p * m, out_dtype,
                             st), pieces
      for b, row in zip(blocks, dest):
        out = _pallas_write(out, data, [b.landing_row], b.rows, w, [row],
                            p * m, out_dtype, st)
      return out, pieces

    (out, pieces), pending = gather.run(x0, gplan, st, consume=consume,
                                        carry=(None, ()))
    gathered = (_assemble(pieces, shift_rows, rank, m, p) if keep_gathered
                else None)
  else:
    out, gathered, pending = _on_xla_dots(x0, w, st, out_dtype, gplan, rank,
                                          keep_gathered=keep_gathered)
  out = gather.finish(out, pending, st)
  if gathered is not None:
    if st.schedule.comm == "dma":
      # A caller that keeps only the gathered operand (a gradient whose
      # primal product is dead) would let JAX drop `finish`, and with it
      # the invocation's end, after which peers no longer read this
      # device's shard: the barrier keeps the end alive with it. The
      # product is returned from before the barrier, so a caller that
      # keeps only the product does not build the gathered copy.
      _, gathered = lax.optimization_barrier((out, gathered))
    gathered = vma.vary_like(gathered, x0)
  # The Pallas kernel's in-place writes leave `out` typed invariant.
  return vma.vary_like(out, x0, w), gathered


def _on_xla_dots(x0, w, st: Static, out_dtype, gplan, rank, *,
                 keep_gathered: bool):
  """The overlapped product on XLA's dots: ``(out, gathered, pending)``,
  ``gathered`` the gathered ``x0`` in rank order when ``keep_gathered``
  (else None), assembled from the pieces as they landed."""
  p, m = st.axis_size, x0.shape[0]
  step = st.schedule.granularity(st.op_name) == "step"
  shift_rows: list[int] = []  # Static, in the order of the products.

  def consume(carry, data, blocks):
    products, pieces = carry
    if step and len(blocks) > 1:
      # One matmul for the whole landing buffer (all peers' piece c in
      # the direct dataflow); the assembly slices its blocks.
      y = matmul.dot(data, w, st).astype(out_dtype)
    new, kept = [], []
    for b in blocks:
      piece = gather.block_rows(data, b)
      if keep_gathered:
        kept.append(piece)
      if step and len(blocks) > 1:
        product = gather.block_rows(y, b)
      else:
        product = matmul.dot(piece, w, st).astype(out_dtype)
      shift_rows.append(gather.shift_row(b, p, m))
      new.append(product)
    return products + tuple(new), pieces + tuple(kept)

  (products, pieces), pending = gather.run(x0, gplan, st, consume=consume,
                                           carry=((), ()))
  out = _assemble(products, shift_rows, rank, m, p)
  gathered = (_assemble(pieces, shift_rows, rank, m, p) if keep_gathered
              else None)
  return out, gathered, pending


def _push(x0, w, st: Static, out_dtype, keep_gathered: bool):
  """``compute_granularity="flagged"``: the push all-gather (docs/windows.md,
  "Push all-gather"), one call that pushes ``x0`` into every peer's window
  and multiplies each shard where it landed, behind a device-side wait for
  its arrival flag; with ``keep_gathered`` the call also copies each shard
  out of the window as it lands (the gathered operand, in ``x0``'s dtype
  promoted with ``w``'s). ``rest`` folds into rows (each rank's rows stay
  one contiguous block of the 2-D result)."""
  from ficco_jax._src.dma import peer_copy  # Optional dependency.
  from ficco_jax._src.dma import push

  p, m = st.axis_size, x0.shape[0]
  rest = x0.shape[1:-1]
  # The handler's GEMM takes one input type (jax's promotion of the two)
  # and writes that type, or float32 from 16-bit inputs.
  op_dtype = in_dtype = jnp.promote_types(x0.dtype, w.dtype)
  widest = jnp.dtype(jnp.float32) if in_dtype.itemsize == 2 else in_dtype
  if out_dtype == in_dtype:
    gemm_out = out_dtype
  elif (jnp.issubdtype(out_dtype, jnp.floating)
        and out_dtype.itemsize > widest.itemsize):
    # A result wider than the GEMM writes from these inputs (f64 from f32
    # or 16-bit ones): multiply in the result's type, so that nothing is
    # rounded below it (the shards then move in that type too).
    in_dtype = gemm_out = out_dtype
  else:
    # Any other type (f32, the other 16-bit type, a narrower one): the
    # widest the GEMM writes, then one rounding, as XLA's dot (f16 sums
    # past 65504 stay finite for a bf16 result).
    gemm_out = widest
  x2 = x0.reshape(-1, x0.shape[-1]).astype(in_dtype)
  out, gathered = push.gather(
      x2, w.astype(in_dtype), out_dtype=gemm_out, axis_size=p,
      axis_name=st.axis_name, site=peer_copy.new_site(), op_name=st.op_name,
      timeout_s=st.timeout_s, keep_gathered=keep_gathered)
  out = out.astype(out_dtype).reshape((p * m,) + rest + (w.shape[1],))
  if gathered is not None:
    # In the operands' promoted type, whatever the GEMM ran in (a widening
    # cast, undone exactly).
    gathered = vma.vary_like(
        gathered.astype(op_dtype).reshape((p * m,) + rest + (x0.shape[-1],)),
        x0)
  return vma.vary_like(out, x0, w), gathered


def _signalled(x0, w, st: Static, out_dtype, keep_gathered: bool):
  """``compute_granularity="flagged"`` with ``compute="pallas"``: the
  signalled all-gather. One window start pulls every peer's chunks into
  landing buffers (one per chunk: that chunk of every peer) and sets a
  landing flag in device memory as each piece lands; the own shard's
  kernel runs meanwhile; then one kernel launch per landing buffer walks
  its pieces in landing order, each CTA waiting in the kernel for a piece's
  flag before it loads the piece's rows, so compute starts on the first
  piece while the others are still in flight, with no stream wait and no
  launch per piece. Before each such launch XLA's thread waits on the host
  until the copies are enqueued (as the push all-gather does before its
  device waits). The interpreted kernel (CPU) cannot wait: there the
  pieces are awaited first (the window transport's wait), and the CPU twin
  still runs every protocol step."""
  from ficco_jax._src.dma import peer_copy  # Optional dependency.
  from ficco_jax._src.pallas import chunk_matmul

  p, m = st.axis_size, x0.shape[0]
  # As in _run: the start belongs to the whole product (see there).
  x0, w = lax.optimization_barrier((x0, w))
  rank = lax.axis_index(st.axis_name)
  gplan = plan_lib.gather_plan(st.schedule, axis_size=p, shard_rows=m)
  site = peer_copy.new_site()
  kw = dict(st.copy_kwargs(), transport="window")
  *landings, flags = peer_copy.start([x0], gplan, site=site, landed=True,
                                     **kw)
  in_kernel = chunk_matmul.waits_in_kernel()
  # The own shard first, on the compute stream, while the pieces fly.
  x0_ordered, landings = lax.optimization_barrier((x0, landings))
  out = _pallas_write(None, x0_ordered, [0], m, w, [rank * m], p * m,
                      out_dtype, st)
  read = []  # The landing buffers the kernels read, in order.
  for b, landing in enumerate(landings):
    blocks = gplan.blocks_of(b)
    # In the kernel's case the wait only holds XLA's thread until the
    # flags' writes are enqueued (a kernel that spins on a write not yet
    # enqueued could hold the very hardware queue the write needs); with
    # the interpreter it waits for the pieces. After the previous launch:
    # XLA orders custom calls by data alone, and a host wait hoisted above
    # the own shard's launch would hold that launch back too.
    out, landing = lax.optimization_barrier((out, landing))
    landing = peer_copy.wait(landing, site=site, landed=in_kernel, **kw)
    landed = ((flags, [_transfer_of(gplan, b, blk) for blk in blocks])
              if in_kernel else None)
    rows = {blk.rows for blk in blocks}
    if len(rows) != 1:
      raise AssertionError(f"direct pieces of unequal rows {sorted(rows)}")
    out = _pallas_write(
        out, landing, [blk.landing_row for blk in blocks], rows.pop(), w,
        [gather.owner_rank(blk, rank, p) * m + blk.owner_row
         for blk in blocks], p * m, out_dtype, st, landed=landed)
    read.append(landing)
  gathered = None
  if keep_gathered:
    # Read the landing buffers only after the kernels that waited for
    # them: XLA orders the copies by data alone.
    out, read = lax.optimization_barrier((out, read))
    pieces, shift_rows = [x0], [0]
    for b, landing in enumerate(read):
      pieces += [gather.block_rows(landing, blk) for blk in gplan.blocks_of(b)]
      shift_rows += [gather.shift_row(blk, p, m) for blk in gplan.blocks_of(b)]
    gathered = vma.vary_like(_assemble(pieces, shift_rows, rank, m, p), x0)
  # The flags stay alive until the copy queues are done writing them: a
  # consumer that did not read them (the CPU twin's) would otherwise let
  # XLA reuse their memory under the queues' last writes.
  out = peer_copy.done(out, [x0, flags], site=site, **kw)
  if gathered is not None:
    # As in _run: keep the end alive with the gathered operand.
    _, gathered = lax.optimization_barrier((out, gathered))
  return vma.vary_like(out, x0, w), gathered


def _transfer_of(gplan, landing: int, block) -> int:
  """The transfer that lands ``block`` (its flag's index)."""
  for i, t in enumerate(gplan.transfers):
    if t.dst == landing and t.dst_row == block.landing_row:
      return i
  raise AssertionError(f"no transfer lands {block} in landing {landing}")
