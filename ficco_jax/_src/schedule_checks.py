"""What a tensor-parallel op needs of a schedule beyond the schedule's own
checks (`Schedule.__post_init__`): checks that depend on the op, the
operands' dtypes and how the call is traced.

The op raises them for a schedule it is given; `resolve` asks them of an
autotune-cache entry before serving it (`unfit`), so that ``schedule=None``
never resolves to a schedule the call then refuses, and
`ficco_jax.choose_schedule` agrees with what the op runs.
"""

from __future__ import annotations

import jax.numpy as jnp

from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import validation
from ficco_jax._src.pallas import config as pallas_config


def check(op: str, schedule: schedule_lib.Schedule, *, a_name: str, dtype,
          out_dtype, axis_size: int, operand_kind: str | None) -> None:
  """Raises where the call cannot run ``schedule``.

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    schedule: the schedule.
    a_name: the first operand's name in errors (``x`` or ``h``).
    dtype: the operands' dtype (promoted together).
    out_dtype: the result's dtype (None: ``dtype``).
    axis_size: devices along the axis.
    operand_kind: the first operand's type name (a tracer's, which says how
      the call is traced), or None for a call under ``jax.jit``.

  Raises:
    ValueError, TypeError, NotImplementedError: naming what does not fit.
  """
  if schedule.comm == "dma" and schedule.overlapped and axis_size > 1:
    validation.check_program_kind(op, operand_kind)
  if schedule.compute_granularity == "flagged":
    _check_flagged(op, schedule)
  elif (op == "all_gather_matmul"
        and schedule.compute_granularity == "halving"):
    # The all-gather waits for a step's pieces in one landing buffer, so
    # smaller groups would only mean more dots.
    raise ValueError(
        "schedule.compute_granularity='halving' is the reduce-scatter's;"
        " all_gather_matmul takes 'piece', 'step', 'flagged' or None.")
  if schedule.compute == "pallas" and schedule.overlapped:
    _check_pallas_dtypes(op, a_name, dtype, out_dtype)


def unfit(op: str, schedule: schedule_lib.Schedule, **call) -> str | None:
  """Why the call cannot run ``schedule`` (`check`'s error, in words), or
  None where it can; ``call`` as `check` takes it."""
  try:
    check(op, schedule, **call)
  except (ValueError, TypeError, NotImplementedError) as e:
    return str(e)
  return None


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


def _check_flagged(op: str, schedule: schedule_lib.Schedule) -> None:
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
