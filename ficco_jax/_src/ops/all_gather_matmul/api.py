"""``ficco_jax.all_gather_matmul``: the public op and its custom VJP."""

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
from ficco_jax._src.ops.all_gather_matmul import forward
from ficco_jax._src.ops.matmul_reduce_scatter import forward as rs_forward

DEFAULT_TIMEOUT_S = 60.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ag(x, w, axis: int, st: Static):
  out0 = forward.forward(jnp.moveaxis(x, axis, 0), w, st)
  return jnp.moveaxis(out0, 0, axis)


def _ag_fwd(x, w, axis, st):
  out0, gathered = forward.forward_and_gathered(jnp.moveaxis(x, axis, 0), w,
                                                st)
  # The gathered x is the residual, as in XLA's own autodiff of all_gather
  # + dot: dw is then one dot, with no second gather (the push all-gather
  # copies it out of its window too).
  return jnp.moveaxis(out0, 0, axis), (x, w, gathered)


def _ag_bwd(axis, st, res, ct):
  x, w, gathered = res
  ct0 = jnp.moveaxis(ct, axis, 0)
  # d(all_gather(x) @ w)/dx is a reduce-scatter of ct @ w^T.
  dx0 = rs_forward.forward(
      ct0, w.T, matmul.backward_static(st, "matmul_reduce_scatter"))
  dw = contraction.contract_rows(
      gathered, ct0, st,
      jnp.promote_types(jnp.promote_types(x.dtype, ct0.dtype), w.dtype))
  dx = jnp.moveaxis(dx0, 0, axis).astype(x.dtype)
  return vma.match(dx, x), vma.match(dw.astype(w.dtype), w)


_ag.defvjp(_ag_fwd, _ag_bwd)


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    axis_name: str,
    gather_axis: int = 0,
    schedule: schedule_lib.Schedule | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> jax.Array:
  """``lax.all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w``, overlapped.

  Call inside ``jax.shard_map`` (for global arrays under ``jit`` use
  `ficco_jax.sharded.all_gather_matmul`). The gather is decomposed into
  pieces finer than a shard and each piece's matmul overlaps the transfer of
  the next, as ``schedule`` says. Differentiable: the gradient's ``dx`` is a
  reduce-scatter matmul, overlapped the same way, and its ``dw`` one dot of
  the gathered ``x``, kept from the forward pass as XLA's own autodiff
  does (the push granularity's copy engines copy each shard out of its
  window as it lands).

  Args:
    x: the local shard, any rank >= 2: ``[..., m, ..., K]`` with ``m`` at
      ``gather_axis``; the last axis is contracted.
    w: the local weight ``[K, n]`` (for a column-parallel layer, this
      device's columns).
    axis_name: the ``shard_map`` mesh axis to gather over, of size ``P``.
    gather_axis: the axis of ``x`` that is gathered (not the last).
    schedule: a `ficco_jax.Schedule`. None: the autotune cache's entry for
      these local shapes on this device kind (`ficco_jax.autotune`), else
      the cost-model heuristic (`ficco_jax.explain` shows which and why).
    precision: passed to ``lax.dot_general``.
    preferred_element_type: result dtype of the matmul (None: as for
      ``x @ w``).
    timeout_s: ``comm="dma"`` only: how long a device waits for its peers
      before raising instead of hanging.

  Returns:
    ``[..., P * m, ..., n]``: the gathered ``x`` times ``w``, on every device
    of the axis.

  Raises:
    TypeError, ValueError: an argument is not what the op takes; the message
      names it, its shape and what was expected.
  """
  x, w = prepare.promoted("x", x, w)
  axis, st = prepare.prepare(
      "all_gather_matmul", x, w, a_name="x", axis_arg="gather_axis",
      axis=gather_axis, axis_name=axis_name, schedule=schedule,
      precision=precision, preferred_element_type=preferred_element_type,
      timeout_s=timeout_s)
  return _ag(x, w, axis, st)
