"""``ficco_jax.matmul_reduce_scatter``: the public op and its custom VJP."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ficco_jax._src import matmul
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import vma
from ficco_jax._src.matmul import Static
from ficco_jax._src.ops import contraction
from ficco_jax._src.ops import prepare
from ficco_jax._src.ops.all_gather_matmul import forward as ag_forward
from ficco_jax._src.ops.all_gather_matmul.api import DEFAULT_TIMEOUT_S
from ficco_jax._src.ops.matmul_reduce_scatter import forward


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rs(h, w, axis: int, st: Static):
  out0 = forward.forward(jnp.moveaxis(h, axis, 0), w, st)
  return jnp.moveaxis(out0, 0, axis)


def _rs_fwd(h, w, axis, st):
  return _rs(h, w, axis, st), (h, w)


def _rs_bwd(axis, st, res, ct):
  h, w = res
  ct0 = jnp.moveaxis(ct, axis, 0)
  # dh = all_gather(ct) @ w^T, overlapped piece by piece; dw = h^T @
  # all_gather(ct) from the same gather, one dot once every piece landed:
  # the cotangent travels once, and dw needs no f32 accumulator or row
  # slices of h per piece.
  gather_st = matmul.backward_static(st, "all_gather_matmul")
  dh0, gathered = ag_forward.forward_and_gathered(ct0, w.T, gather_st)
  assert gathered is not None  # backward_static leaves no push gather.
  h0 = jnp.moveaxis(h, axis, 0)
  # In w's dtype when that is the widest (an f32 master weight), so dw is
  # not rounded to the activations' dtype first.
  dw = contraction.contract_rows(
      h0, gathered, st,
      jnp.promote_types(jnp.promote_types(h0.dtype, ct0.dtype), w.dtype))
  dh = jnp.moveaxis(dh0, 0, axis).astype(h.dtype)
  return vma.match(dh, h), vma.match(dw.astype(w.dtype), w)


_rs.defvjp(_rs_fwd, _rs_bwd)


def matmul_reduce_scatter(
    h: jax.Array,
    w: jax.Array,
    *,
    axis_name: str,
    scatter_axis: int = 0,
    schedule: schedule_lib.Schedule | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> jax.Array:
  """``lax.psum_scatter(h @ w, axis_name, scatter_dimension=scatter_axis, tiled=True)``.

  Call inside ``jax.shard_map`` (for global arrays use
  `ficco_jax.sharded.matmul_reduce_scatter`). Each device computes partial
  products piece by piece and the pieces are reduced on their way to the
  device that owns their rows, overlapped with the next piece's matmul.
  Differentiable: the gradient's ``dh`` is an all-gather matmul of the
  cotangent, and ``dw`` one dot of ``h`` with the cotangent that gather
  assembled (it travels once).

  Args:
    h: the local operand, any rank >= 2: ``[..., P * m, ..., F]`` with the
      scattered axis at ``scatter_axis``; the last axis (this device's slice
      of the contraction) is contracted.
    w: the local weight ``[F, n]`` (for a row-parallel layer, this device's
      rows).
    axis_name: the ``shard_map`` mesh axis to reduce and scatter over.
    scatter_axis: the axis of the result that is scattered (not the last).
    schedule: a `ficco_jax.Schedule`. None: the autotune cache's entry for
      these local shapes on this device kind (`ficco_jax.autotune`), else
      the cost-model heuristic (`ficco_jax.explain` shows which and why).
    precision: passed to ``lax.dot_general``.
    preferred_element_type: result dtype of the matmul.
    timeout_s: ``comm="dma"`` only: how long to wait for peers.

  Returns:
    ``[..., m, ..., n]``: this device's rows of the sum over the axis.

  Raises:
    TypeError, ValueError: an argument is not what the op takes; the message
      names it, its shape and what was expected.
  """
  h, w = prepare.promoted("h", h, w)
  axis, st = prepare.prepare(
      "matmul_reduce_scatter", h, w, a_name="h", axis_arg="scatter_axis",
      axis=scatter_axis, axis_name=axis_name, schedule=schedule,
      precision=precision, preferred_element_type=preferred_element_type,
      timeout_s=timeout_s)
  return _rs(h, w, axis, st)
