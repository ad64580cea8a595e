"""The two MoE ops' forward passes: rows exchanged per peer, each peer's
rows multiplied by the local experts as one piece (FiCCO's decomposition of
``all_to_all -> grouped matmul -> all_to_all``).

Layouts (per device; P devices, E_l local experts, T tokens, C capacity):

* tokens ``x [T, d]``, sorted by global expert, ``group_sizes [P * E_l]``;
* received rows ``[C, .]``: source-major, packed (peer 0's rows for this
  device's experts, grouped by expert, then peer 1's, ...), then zeros;
* a piece is one peer's rows, at most ``piece_rows`` of them (by default
  ``min(T, C)``: a peer sends no more than its T tokens, a device keeps no
  more than C; the ops' ``piece_capacity`` lowers it). Pieces have that
  static size whatever the counts, so each direction moves ``P *
  piece_rows`` rows per device: with the default capacity, P times the
  routed rows. Capacities near the rows really sent keep this close to the
  routed work. The grouped matmul on XLA's ``ragged_dot`` also spans the
  whole piece; ``compute="pallas"`` (`grouped_matmul`) multiplies only the
  tiles that hold routed rows.

``dataflow="none"`` moves every piece with one ``lax.all_to_all`` and then
multiplies; ``"direct"`` sends piece k with its own ``ppermute`` (shift k)
and multiplies each piece as it is needed, the own piece first, so XLA can
run the next transfer beside the current piece's grouped matmul. Both are
plain JAX, so their gradients are JAX's (the transpose of a ppermute is the
reverse ppermute: the backward pass is decomposed the same way).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp

from ficco_jax._src.ops.moe import routing as routing_lib
from ficco_jax._src.pallas import grouped_matmul


@dataclasses.dataclass(frozen=True)
class MoeStatic:
  """Static configuration of one MoE op call."""

  op_name: str
  axis_name: str
  axis_size: int
  capacity: int
  piece_rows: int
  dataflow: str
  compute: str
  precision: Any
  out_dtype: Any


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(a, ((0, rows), (0, 0)))


def add_rows(buf: jax.Array, block: jax.Array, start) -> jax.Array:
  """``buf[start:start + len(block)] += block``: blocks may overlap only in
  rows that are zero in one of them (padding), so adding places each."""
  cur = lax.dynamic_slice_in_dim(buf, start, block.shape[0], axis=0)
  return lax.dynamic_update_slice_in_dim(buf, cur + block, start, axis=0)


def grouped(rows: jax.Array, w: jax.Array, sizes: jax.Array,
             st: MoeStatic) -> jax.Array:
  """One piece through the local experts; rows past ``sum(sizes)`` (the
  next peer's rows, or padding) are 0, which `add_rows` relies on:
  masked here, since ``ragged_dot`` does not promise it on every backend."""
  sizes = sizes.astype(jnp.int32)
  if st.compute == "pallas":
    return grouped_matmul.grouped_matmul(rows, w, sizes,
                                         out_dtype=st.out_dtype)
  out = lax.ragged_dot(rows, w, sizes, precision=st.precision,
                       preferred_element_type=st.out_dtype)
  return grouped_matmul.zero_past_groups(out, sizes)


def _shift(a: jax.Array, k: int, st: MoeStatic) -> jax.Array:
  """Device i's ``a`` to device (i + k) % P."""
  p = st.axis_size
  return lax.ppermute(a, st.axis_name, [(i, (i + k) % p) for i in range(p)])


def dispatch(x: jax.Array, w: jax.Array, r: routing_lib.Routing,
             st: MoeStatic) -> jax.Array:
  """``[C, f]``: the rows this device receives, through its experts."""
  p, cap = st.axis_size, st.piece_rows
  rank = lax.axis_index(st.axis_name)
  x_pad = _pad_rows(x, cap)  # A piece never reads past the end.
  piece_for = lambda dest: lax.dynamic_slice_in_dim(
      x_pad, r.send_offset[dest], cap, axis=0)
  out = jnp.zeros((st.capacity + cap, w.shape[-1]), st.out_dtype)

  def consume(out, rows, src):
    block = grouped(rows, w, r.recv[src], st)
    return add_rows(out, block, r.recv_offset[src])

  if st.dataflow == "none":
    pieces = jnp.stack([piece_for(d) for d in range(p)])
    got = lax.all_to_all(pieces, st.axis_name, 0, 0, tiled=True)
    for src in range(p):
      out = consume(out, got[src], src)
  else:
    for k in range(p):
      dest = (rank + k) % p
      rows = piece_for(dest)
      if k:
        rows = _shift(rows, k, st)
      out = consume(out, rows, (rank - k) % p)
  return out[:st.capacity]


def combine(h: jax.Array, w: jax.Array, r: routing_lib.Routing,
            num_tokens: int, st: MoeStatic) -> jax.Array:
  """``[T, f]``: ``h``'s rows through this device's experts, each back at
  the position its token had on the device that sent it."""
  p, t, cap = st.axis_size, num_tokens, st.piece_rows
  rank = lax.axis_index(st.axis_name)
  h_pad = _pad_rows(h, cap)

  def block_for(src):
    # Rows past this peer's count belong to the next peer; the grouped
    # matmul gives them 0, so only this peer's products travel back.
    rows = lax.dynamic_slice_in_dim(h_pad, r.recv_offset[src], cap, axis=0)
    return grouped(rows, w, r.recv[src], st)

  y = jnp.zeros((t + cap, w.shape[-1]), st.out_dtype)
  if st.dataflow == "none":
    blocks = jnp.stack([block_for(s) for s in range(p)])
    got = lax.all_to_all(blocks, st.axis_name, 0, 0, tiled=True)
    for dest in range(p):
      y = add_rows(y, got[dest], r.send_offset[dest])
  else:
    for k in range(p):
      src = (rank + k) % p  # The peer whose rows this block is.
      block = block_for(src)
      if k:
        block = _shift(block, k, st)
      # Received from device (rank - k) % P: this device's rows there.
      y = add_rows(y, block, r.send_offset[(rank - k) % p])
  return y[:t]


def with_xla_gradient(forward: Callable, xla: Callable) -> Callable:
  """``op(a, w, r, statics)``: ``forward(a, w, r, *statics)`` with the
  gradient of ``xla(a, w, r, *statics)``, recomputed in the backward pass.

  For the copy-engine forms, whose primitives have no autodiff rules; ``r``
  (the call's `routing_lib.Routing`, integer counts) is not differentiated.
  """
  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def op(a, w, r, statics):
    return forward(a, w, r, *statics)

  def fwd(a, w, r, statics):
    return forward(a, w, r, *statics), (a, w, r)

  def bwd(statics, res, ct):
    a, w, r = res
    _, vjp = jax.vjp(lambda a, w: xla(a, w, r, *statics), a, w)
    return (*vjp(ct), None)

  op.defvjp(fwd, bwd)
  return op
