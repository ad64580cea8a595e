"""The public collective matmuls, for use inside ``jax.shard_map``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ficco_jax._src import ag_matmul
from ficco_jax._src import autotune_cache
from ficco_jax._src import heuristics
from ficco_jax._src import rs_matmul
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import validation
from ficco_jax._src import vma


DEFAULT_TIMEOUT_S = 60.0
Static = ag_matmul.Static


def default_schedule(op, *, x_shape, w_shape, dtype, axis_size, axis,
                     device_kind=None) -> tuple[schedule_lib.Schedule, str]:
  """What ``schedule=None`` becomes, and where it came from.

  Steps 2 and 3 of `_resolve`'s order (`ficco_jax.explain` reports the same).

  Args:
    op: the op's name.
    x_shape, w_shape: local shapes, as the op sees them inside shard_map.
    dtype: the first operand's dtype.
    axis_size: devices along the axis.
    axis: the gathered / scattered axis of the first operand.
    device_kind: None: `heuristics.default_device_kind`, the kind of the
      default backend's first device (shard_map tracing has no concrete
      device; this assumes the mesh is made of that backend's devices).

  Returns:
    ``(schedule, "autotune cache")`` or ``(schedule, "heuristic")``.
  """
  device_kind = device_kind or heuristics.default_device_kind()
  cached = cached_schedule(op, device_kind=device_kind, axis_size=axis_size,
                           x_shape=x_shape, w_shape=w_shape, axis=axis,
                           dtype=dtype)
  if cached is not None:
    return cached, "autotune cache"
  if jax.process_count() > 1:
    heuristics.warn_once(
        f"ficco_jax: schedule=None in a job of {jax.process_count()}"
        " processes found no autotune entry measured in that layout, so the"
        " cost model picks, and it was fitted in one process driving every"
        " GPU (the rendezvous transport; across processes the copy engines"
        " run the window transport). Run ficco_jax.autotune(...) in this job,"
        " or pass a schedule.")
  return heuristics.choose_schedule(
      op, x_shape=x_shape, w_shape=w_shape, dtype=dtype, axis_size=axis_size,
      axis=axis), "heuristic"


def cached_schedule(op, *, device_kind, axis_size, x_shape, w_shape, axis,
                    dtype) -> schedule_lib.Schedule | None:
  """The autotune cache's schedule for an op, or None (step 2 of `_resolve`).

  Keyed by this job's process count too (`autotune_cache.Key`), and tried
  for each shape of `_cache_shapes`.
  """
  for shape, ax in _cache_shapes(x_shape, axis):
    key = autotune_cache.Key.of(op, device_kind=device_kind,
                                axis_size=axis_size, x_shape=shape,
                                w_shape=w_shape, axis=ax, dtype=dtype,
                                processes=jax.process_count())
    cached = autotune_cache.lookup(key)
    if cached is not None and _fits(op, cached, x_shape, axis, axis_size):
      return cached
  return None


def _cache_shapes(x_shape, axis):
  """The operand shapes whose cache entries fit this op, best match first.

  The shape itself; then, when every dimension before ``axis`` is 1 (a
  sequence-parallel ``[1, S / P, d]`` activation, say), the 2-D ``[rows,
  K]`` the op reduces to: moving ``axis`` first is then free and the op
  folds the remaining dims into rows, so it runs the same dots and moves
  the same bytes as the 2-D op the shipped cache was measured on.
  """
  x_shape = tuple(int(d) for d in x_shape)
  yield x_shape, axis
  if len(x_shape) > 2 and all(d == 1 for d in x_shape[:axis]):
    yield (int(np.prod(x_shape[:-1])), x_shape[-1]), 0


def _fits(op, schedule, x_shape, axis, axis_size) -> bool:
  # A 2-D entry's chunk count divides the folded rows; the op cuts along
  # ``axis`` only.
  split = x_shape[axis]
  if op == "matmul_reduce_scatter":
    split //= axis_size
  return split % schedule.num_chunks == 0


def _resolve(op, schedule, *, a, w, axis, axis_size):
  """The schedule a call runs. The one order, first match wins:

  1. ``schedule``, when the caller passes one;
  2. the autotune cache entry for (device kind, axis size, op, local shapes,
     axis, dtype, process count), see `cached_schedule`: the user's file
     (`ficco_jax.set_autotune_cache`, default
     ``~/.cache/ficco_jax/autotune.json``) over the package's shipped data;
  3. the heuristic, `heuristics.choose_schedule` (a cost model).

  Steps 2 and 3 run at trace time, so a jitted function keeps the schedule
  it was traced with; autotune before the first call to use its result.
  """
  if schedule is None:
    schedule, _ = default_schedule(op, x_shape=a.shape, w_shape=w.shape,
                                   dtype=a.dtype, axis_size=axis_size,
                                   axis=axis)
    return schedule
  if not isinstance(schedule, schedule_lib.Schedule):
    raise TypeError(
        f"schedule must be a ficco_jax.Schedule or None, got {schedule!r}.")
  return schedule


def _static(op, axis_name, axis_size, schedule, precision,
            preferred_element_type, timeout_s):
  if not timeout_s > 0:
    raise ValueError(f"{timeout_s=} must be positive.")
  if (op == "all_gather_matmul"
      and schedule.compute_granularity in ("halving", "flagged")):
    # The all-gather waits for a step's pieces in one landing buffer, so
    # smaller groups would only mean more dots; and its copies read the
    # inputs, which no kernel of the op writes (nothing to flag).
    raise ValueError(
        f"schedule.compute_granularity={schedule.compute_granularity!r} is"
        " the reduce-scatter's; all_gather_matmul takes 'piece', 'step' or"
        " None.")
  pet = (None if preferred_element_type is None
         else np.dtype(preferred_element_type))
  return Static(axis_name=axis_name, axis_size=axis_size, schedule=schedule,
                precision=precision, preferred_element_type=pet, op_name=op,
                timeout_s=float(timeout_s))


def _backward_static(st: Static, op: str) -> Static:
  """The config of the collective matmuls that make up a gradient."""
  # Gradients may arrive in float32 (preferred_element_type), which the
  # Hopper kernels do not take, so the backward matmuls are XLA dots; they
  # keep the forward schedule's dataflow, chunks and comm engine.
  schedule = st.schedule
  if schedule.compute_granularity == "flagged":
    # Flagged needs ficco's kernel, which the backward's XLA dots are not:
    # its gradients run "piece" (the same overlap, one start per piece).
    schedule = dataclasses.replace(schedule, compute_granularity="piece")
  schedule = dataclasses.replace(schedule, compute="xla", num_sms=None)
  if op == "all_gather_matmul" and schedule.compute_granularity == "halving":
    # A reduce-scatter's "halving" has no all-gather form (see _static):
    # its gradient's gather runs at the all-gather's default granularity.
    schedule = dataclasses.replace(schedule, compute_granularity=None)
  return dataclasses.replace(st, schedule=schedule, op_name=op,
                             preferred_element_type=None)


# --------------------------------------------------------------------------
# all_gather_matmul
# --------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ag(x, w, axis: int, st: Static):
  out0 = ag_matmul.forward(jnp.moveaxis(x, axis, 0), w, st)
  return jnp.moveaxis(out0, 0, axis)


def _ag_fwd(x, w, axis, st):
  return _ag(x, w, axis, st), (x, w)


def _ag_bwd(axis, st, res, ct):
  x, w = res
  ct0 = jnp.moveaxis(ct, axis, 0)
  # d(all_gather(x) @ w)/dx is a reduce-scatter of ct @ w^T; dw contracts the
  # gathered x with ct, which gathers x piecewise again.
  dx0 = rs_matmul.forward(ct0, w.T, _backward_static(st, "matmul_reduce_scatter"))
  dw = ag_matmul.gathered_contraction(
      jnp.moveaxis(x, axis, 0), ct0, _backward_static(st, "all_gather_matmul"),
      gather_operand="a")
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
  the next, as ``schedule`` says.

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
  """
  op = "all_gather_matmul"
  validation.check_array("x", x)
  validation.check_weight("w", w, x.shape[-1], f"x.shape[-1] of x {tuple(x.shape)}")
  axis = validation.normalize_axis("gather_axis", gather_axis, x.ndim, x.shape)
  p = validation.axis_size(axis_name, op)
  m = x.shape[axis]
  schedule = _resolve(op, schedule, a=x, w=w, axis=axis, axis_size=p)
  validation.check_divisible(f"x.shape[{axis}] (the local rows gathered, x is"
                             f" {tuple(x.shape)})", m, schedule.num_chunks,
                             "schedule.num_chunks")
  st = _static(op, axis_name, p, schedule, precision, preferred_element_type,
               timeout_s)
  return _ag(x, w, axis, st)


# --------------------------------------------------------------------------
# matmul_reduce_scatter
# --------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rs(h, w, axis: int, st: Static):
  out0 = rs_matmul.forward(jnp.moveaxis(h, axis, 0), w, st)
  return jnp.moveaxis(out0, 0, axis)


def _rs_fwd(h, w, axis, st):
  return _rs(h, w, axis, st), (h, w)


def _rs_bwd(axis, st, res, ct):
  h, w = res
  ct0 = jnp.moveaxis(ct, axis, 0)
  # dh = all_gather(ct) @ w^T; dw = h^T @ all_gather(ct).
  dh0 = ag_matmul.forward(ct0, w.T, _backward_static(st, "all_gather_matmul"))
  dw = ag_matmul.gathered_contraction(
      jnp.moveaxis(h, axis, 0), ct0, _backward_static(st, "all_gather_matmul"),
      gather_operand="g")
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
  """
  op = "matmul_reduce_scatter"
  validation.check_array("h", h)
  validation.check_weight("w", w, h.shape[-1], f"h.shape[-1] of h {tuple(h.shape)}")
  axis = validation.normalize_axis("scatter_axis", scatter_axis, h.ndim, h.shape)
  p = validation.axis_size(axis_name, op)
  rows = h.shape[axis]
  validation.check_divisible(f"h.shape[{axis}] (h is {tuple(h.shape)})", rows,
                             p, f"the size of axis {axis_name!r}")
  m = rows // p
  schedule = _resolve(op, schedule, a=h, w=w, axis=axis, axis_size=p)
  validation.check_divisible(
      f"h.shape[{axis}] // axis size (the rows each device keeps, h is"
      f" {tuple(h.shape)})", m, schedule.num_chunks, "schedule.num_chunks")
  st = _static(op, axis_name, p, schedule, precision, preferred_element_type,
               timeout_s)
  return _rs(h, w, axis, st)
