"""What every public op does before it traces its computation: check the
arguments, resolve the schedule, and build the call's `Static` config."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ficco_jax._src import matmul
from ficco_jax._src import resolve
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import validation
from ficco_jax._src.pallas import config as pallas_config
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
  resolution = resolve.resolve(op, schedule, x_shape=a.shape,
                               w_shape=w.shape, dtype=a.dtype, axis_size=p,
                               axis=axis)
  schedule = resolution.schedule
  validation.check_divisible(what, rows, schedule.num_chunks,
                             "schedule.num_chunks")
  if schedule.comm == "dma" and schedule.overlapped and p > 1:
    validation.check_traced_for_copy_engines(op, a)
  if schedule.compute_granularity == "flagged":
    _check_flagged(op, schedule)
  elif (op == "all_gather_matmul"
        and schedule.compute_granularity == "halving"):
    # The all-gather waits for a step's pieces in one landing buffer, so
    # smaller groups would only mean more dots.
    raise ValueError(
        "schedule.compute_granularity='halving' is the reduce-scatter's;"
        " all_gather_matmul takes 'piece', 'step', 'flagged' or None.")
  if resolution.source != "explicit" and type(a).__name__ != "BatchTracer":
    # A site `ficco_jax.autotune_model` may tune (a no-op unless it traces);
    # not under jax.vmap, where a.shape is one example's, not the work.
    sites.record(op, x_shape=a.shape, w_shape=w.shape, dtype=a.dtype,
                 axis_size=p, axis=axis, axis_name=axis_name,
                 schedule=schedule, source=resolution.source)
  st = matmul.make_static(
      op, axis_name=axis_name, axis_size=p, schedule=schedule,
      precision=precision, preferred_element_type=preferred_element_type,
      timeout_s=timeout_s)
  if schedule.compute == "pallas" and schedule.overlapped:
    _check_pallas_dtypes(op, a_name, a.dtype, st.preferred_element_type)
  return axis, st


def _check_pallas_dtypes(op: str, a_name: str, dtype, out_dtype) -> None:
  """Before tracing, so that the error names the call's arguments rather
  than a kernel's buffer."""
  out_dtype = dtype if out_dtype is None else out_dtype
  for what, dt in ((f"{a_name} and w (promoted together)", dtype),
                   ("the result (preferred_element_type)", out_dtype)):
    if jnp.dtype(dt) not in pallas_config.KERNEL_DTYPES:
      raise TypeError(
          f"{op}: compute='pallas' takes bfloat16, float16 or float32"
          f" operands and results; {what} would be {jnp.dtype(dt).name}."
          " Use Schedule(compute='xla') for this call.")


def _check_flagged(op: str, schedule) -> None:
  """What ``compute_granularity="flagged"`` needs of each op (the schedule
  itself checked dataflow, comm and epilogue)."""
  if op == "matmul_reduce_scatter":
    if schedule.compute != "pallas":
      raise ValueError(
          "matmul_reduce_scatter's compute_granularity='flagged' needs"
          " compute='pallas' (its kernel signals the copy engines), got"
          f" compute={schedule.compute!r}.")
    if schedule.transport == "window":
      raise ValueError(
          "matmul_reduce_scatter's compute_granularity='flagged' travels by"
          " transport='push' or 'rendezvous' (or None), not 'window'.")
    return
  if schedule.compute == "pallas":
    # The signalled all-gather: pulls into XLA's landing buffers, which the
    # kernel reads behind landing flags.
    if schedule.transport not in (None, "window"):
      raise ValueError(
          "all_gather_matmul's compute_granularity='flagged' with"
          " compute='pallas' (the signalled all-gather) travels by"
          f" transport='window' (or None), got"
          f" transport={schedule.transport!r}.")
    return
  # The push all-gather, whose GEMMs read the peers' shards where they
  # landed, in the window.
  if schedule.transport not in (None, "push"):
    raise ValueError(
        "all_gather_matmul's compute_granularity='flagged' travels by"
        f" transport='push' (or None), got transport={schedule.transport!r}.")
  if schedule.num_chunks != 1:
    raise ValueError(
        "all_gather_matmul's compute_granularity='flagged' moves each shard"
        f" as one piece: num_chunks must be 1, got {schedule.num_chunks}.")
