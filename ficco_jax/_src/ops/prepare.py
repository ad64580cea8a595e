"""What every public op does before it traces its computation: check the
arguments, resolve the schedule, and build the call's `Static` config."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ficco_jax._src import matmul
from ficco_jax._src import resolve
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import schedule_checks
from ficco_jax._src import validation
from ficco_jax._src.tuning import sites


def promoted(a_name: str, a: jax.Array,
             w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``a`` and ``w`` in the dtype ``a @ w`` computes in (jax's type
  promotion: float16 with bfloat16 gives float32), as the reference
  ``all_gather(x) @ w`` / ``h @ w`` would."""
  validation.check_array(a_name, a)
  validation.check_array("w", w)
  dtype = jnp.result_type(a, w)
  return a.astype(dtype), w.astype(dtype)


def prepare(op: str, a: jax.Array, w: jax.Array, *, a_name: str,
            axis_arg: str, axis: int, axis_name: str,
            schedule: schedule_lib.Schedule | None, precision: Any,
            preferred_element_type: Any,
            timeout_s: Any) -> tuple[int, matmul.Static]:
  """Checks one call's arguments and resolves its config.

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    a: the first operand (``x`` or ``h``), named ``a_name`` in errors.
    w: the weight.
    axis_arg: the name of the argument ``axis`` came from
      (``gather_axis`` / ``scatter_axis``).
    axis, axis_name, schedule, precision, preferred_element_type,
      timeout_s: the public arguments.

  Returns:
    ``(axis, st)``: the row axis, normalized, and the call's `Static`.
  """
  validation.check_array(a_name, a)
  a_shape = f"{a_name}.shape[-1] of {a_name} {tuple(a.shape)}"
  validation.check_weight("w", w, a.shape[-1], a_shape)
  validation.check_nonempty(a_name, a)
  validation.check_nonempty("w", w)
  timeout_s = validation.check_timeout(timeout_s)
  axis = validation.normalize_axis(axis_arg, axis, a.ndim, a.shape)
  p = validation.axis_size(axis_name, op)
  rows = a.shape[axis]
  if op == "matmul_reduce_scatter":
    validation.check_divisible(f"{a_name}.shape[{axis}] ({a_name} is"
                               f" {tuple(a.shape)})", rows, p,
                               f"the size of axis {axis_name!r}")
    rows //= p
    what = (f"{a_name}.shape[{axis}] // axis size (the rows each device"
            f" keeps, {a_name} is {tuple(a.shape)})")
  else:
    what = (f"{a_name}.shape[{axis}] (the local rows gathered, {a_name} is"
            f" {tuple(a.shape)})")
  kind = validation.operand_kind(a)
  call = dict(a_name=a_name, dtype=a.dtype,
              out_dtype=_out_dtype(preferred_element_type), axis_size=p,
              operand_kind=kind)
  resolution = resolve.resolve(op, schedule, x_shape=a.shape,
                               w_shape=w.shape, axis=axis, call=call)
  schedule = resolution.schedule
  validation.check_divisible(what, rows, schedule.num_chunks,
                             "schedule.num_chunks")
  st = matmul.make_static(
      op, axis_name=axis_name, axis_size=p, schedule=schedule,
      precision=precision, preferred_element_type=preferred_element_type,
      timeout_s=timeout_s)
  schedule_checks.check(op, schedule, **call)
  if resolution.source != "explicit" and kind != "BatchTracer":
    # A site `ficco_jax.autotune_model` may tune (a no-op unless it traces);
    # not under jax.vmap, where a.shape is one example's, not the work.
    sites.record(op, x_shape=a.shape, w_shape=w.shape, dtype=a.dtype,
                 axis_size=p, axis=axis, axis_name=axis_name,
                 schedule=schedule, source=resolution.source)
  return axis, st


def _out_dtype(preferred_element_type) -> np.dtype | None:
  """The result dtype the call asks for (None: the operands'); one that is
  not a dtype is `matmul.make_static`'s to refuse, after resolution."""
  if preferred_element_type is None:
    return None
  try:
    return np.dtype(preferred_element_type)
  except TypeError:
    return None
