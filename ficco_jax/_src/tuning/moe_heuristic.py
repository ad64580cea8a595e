"""``schedule=None`` for the MoE ops: where the experts run, how rows move.

Two decisions, both from the call's static facts:

* the experts' compute: ficco's grouped kernel (``compute="pallas"``)
  wherever it takes the call (`kernel_unfit`), else XLA's ``ragged_dot``,
  which XLA:GPU computes as every row times every local expert;
* the exchange: on the copy engines, a piece per peer (``direct/c1/dma``),
  where the experts' width f is at most `DIRECT_MAX_F`, else one
  all-to-all each way (``none``).

The ops (`ficco_jax.all_to_all_matmul`, `ficco_jax.matmul_all_to_all`),
`ficco_jax.choose_schedule` and `ficco_jax.explain` all decide here, so
they agree.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src.pallas import grouped_matmul
from ficco_jax._src.pallas.config import MGPU_DTYPES

OPS = ("all_to_all_matmul", "matmul_all_to_all")
DATAFLOWS = ("none", "direct")
# Per routed row the exchange moves d elements and the experts multiply
# them by f, so the exchange's share of the layer grows as f shrinks. On
# 2xH200 (4096 tokens per device, balanced and Zipf routing, the grouped
# kernel; benchmarks/results/nvidia_h200_w2/moe.json) direct/dma took
# 15-21% less time than ``none`` at f = 768 (qwen3-30b-a3b) and 1408
# (deepseek-v2-lite), where the exchange is 0.6-0.95x the experts' time,
# and 1-5% more at f = 14336 and 16384 (mixtral), where it is a tenth.
# Fitted on two widths, checked on the third; a cost model of the pattern
# would replace it.
DIRECT_MAX_F = 4096
# Device kinds planned for as Hopper (sm_90) when they are not at hand
# (`choose_schedule(..., device_kind=...)`): the kernel's wgmma is sm_90's.
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def expert_width(op: str, w_shape) -> int:
  """The experts' hidden width f: ``w [E_l, d, f]`` for the dispatch's
  matmul, ``[E_l, f, d]`` for the combine's."""
  return int(w_shape[2] if op == "all_to_all_matmul" else w_shape[1])


def kind_is_hopper(device_kind: str) -> bool:
  return any(k in device_kind for k in HOPPER_KINDS)


def kernel_unfit(*, w_shape, dtype, w_dtype=None, out_dtype=None,
                 precision=None, hopper: bool,
                 device_desc: str) -> str | None:
  """Why the GPU grouped kernel cannot take the call (forward and
  gradient), or None. Its tiles must divide d and f, and the gradient's dx
  swaps them, so both must be multiples of the smallest tile."""
  dtype = jnp.dtype(dtype)
  if not hopper or dtype not in MGPU_DTYPES:
    return (f"it needs a Hopper (sm_90) GPU and bf16/f16 rows; here"
            f" {device_desc} with {dtype} rows")
  if w_dtype is not None and jnp.dtype(w_dtype) != dtype:
    return f"w is {jnp.dtype(w_dtype)}, the rows {dtype}"
  if out_dtype is not None and jnp.dtype(out_dtype) != dtype:
    return (f"preferred_element_type={jnp.dtype(out_dtype)}: its result is"
            f" in the operands' dtype, {dtype}")
  if precision is not None:
    return f"precision={precision!r} applies to XLA's ragged_dot"
  b = grouped_matmul.HOPPER_CONFIGS[-1]  # The kernel's smallest tiles.
  step = math.lcm(b.tile_k, b.cta_tile_n)
  # Named by position: w is [E_l, d, f] for the dispatch, [E_l, f, d] for
  # the combine, and the kernel needs both multiples.
  for i in (1, 2):
    if w_shape[i] % step:
      return (f"w.shape[{i}]={w_shape[i]} (w {tuple(w_shape)}) is not a"
              f" multiple of {step}")
  return None


def unsupported(schedule: schedule_lib.Schedule) -> str | None:
  """Why the MoE ops do not take ``schedule``, or None."""
  supported = dict(num_chunks=1, num_sms=None, compute_granularity=None,
                   reduce_in_epilogue=False)
  for field, want in supported.items():
    if getattr(schedule, field) != want:
      return (f"Schedule({field}={getattr(schedule, field)!r}) is not"
              f" supported by the MoE ops yet; they take dataflow in"
              f" {DATAFLOWS} with {field}={want!r}")
  if schedule.dataflow not in DATAFLOWS:
    return (f"Schedule(dataflow={schedule.dataflow!r}) is not supported by"
            f" the MoE ops; use one of {DATAFLOWS}")
  if schedule.comm == "dma" and schedule.dataflow != "direct":
    return ("Schedule(comm='dma') needs dataflow='direct' (a piece per peer"
            " on the copy engines)")
  return None


def cached_unfit(schedule: schedule_lib.Schedule, *, platform: str,
                 kernel_why: str | None,
                 one_program: bool = True) -> str | None:
  """Why an autotune cache entry cannot serve a call, or None: the MoE ops
  do not take it, its grouped kernel cannot take the call (``kernel_why``,
  `kernel_unfit`'s answer for the call, its ``precision`` included; off
  GPUs the kernel is an interpreter, a test path), or its copy engines
  need the op traced under ``jax.jit``."""
  why = unsupported(schedule)
  if why is None and schedule.compute == "pallas":
    if platform != "gpu":
      why = ("off GPUs the grouped kernel runs Pallas's interpreter, a"
             " test path")
    else:
      why = kernel_why
  if why is None and schedule.comm == "dma" and not one_program:
    why = "the copy engines need the op traced under jax.jit"
  return why


def decide(op: str, *, w_shape, dtype, w_dtype=None, out_dtype=None,
           precision=None, platform: str, hopper: bool, device_desc: str,
           processes: int, one_program: bool = True
           ) -> tuple[schedule_lib.Schedule, str]:
  """``schedule=None``'s schedule for a MoE op, and why, in words.

  Args:
    op: ``"all_to_all_matmul"`` or ``"matmul_all_to_all"``.
    w_shape: the local expert weights (``[E_l, d, f]`` or ``[E_l, f, d]``).
    dtype: the rows' dtype.
    w_dtype, out_dtype, precision: the call's (None: the rows' dtype, and
      no precision).
    platform: ``"gpu"``, ``"cpu"``, ...
    hopper: whether the device is a Hopper (sm_90) GPU.
    device_desc: the device, in words, for the reason.
    processes: processes of the job.
    one_program: whether the op is traced into one compiled program (under
      ``jax.jit``); eager ``shard_map`` and ``vmap`` are not, and the copy
      engines need it (`validation.check_traced_for_copy_engines`).

  Returns:
    ``(schedule, reason)``.
  """
  if platform != "gpu":
    return (schedule_lib.Schedule(dataflow="none"),
            f"on {platform}: one all-to-all each way, the experts on"
            " ragged_dot (the grouped kernel and the copy engines are"
            " GPU paths)")
  why = kernel_unfit(w_shape=w_shape, dtype=dtype, w_dtype=w_dtype,
                     out_dtype=out_dtype, precision=precision, hopper=hopper,
                     device_desc=device_desc)
  if why is not None:
    return (schedule_lib.Schedule(dataflow="none"),
            f"the grouped kernel cannot take the call ({why}): one"
            " all-to-all each way, the experts on ragged_dot")
  f = expert_width(op, w_shape)
  if f > DIRECT_MAX_F:
    return (schedule_lib.Schedule(dataflow="none", compute="pallas"),
            f"the experts' width f={f} > {DIRECT_MAX_F}: the exchange is a"
            " small share of the layer, so one all-to-all each way; the"
            " experts on the grouped kernel")
  if not one_program:
    return (schedule_lib.Schedule(dataflow="none", compute="pallas"),
            f"f={f} <= {DIRECT_MAX_F} would take the copy engines, but the"
            " op is not traced under jax.jit (eager shard_map or vmap),"
            " which they need: one all-to-all each way; the experts on the"
            " grouped kernel")
  if processes > 1:
    return (schedule_lib.Schedule(dataflow="none", compute="pallas"),
            f"f={f} <= {DIRECT_MAX_F} would take the copy engines, but this"
            f" job has {processes} processes, where the MoE copy-engine"
            " dataflow is not tested: one all-to-all each way; the experts"
            " on the grouped kernel")
  return (schedule_lib.Schedule(dataflow="direct", comm="dma",
                                compute="pallas"),
          f"the experts' width f={f} <= {DIRECT_MAX_F}: the exchange is a"
          " large share of the layer, so each peer's piece moves on the"
          " copy engines while the own piece is multiplied; the experts on"
          " the grouped kernel")


def candidates(*, kernel_runs: bool, dma: bool) -> tuple[
    schedule_lib.Schedule, ...]:
  """`ficco_jax.autotune`'s default candidates for a MoE op: each dataflow
  (one all-to-all, a piece per peer over XLA's collectives, and where the
  copy-engine library runs a piece per peer on the copy engines) with the
  experts on ``ragged_dot`` and, where the GPU kernel takes the call, on
  the grouped kernel (off GPUs its interpreter is a test path, not timed)."""
  computes = ("xla", "pallas") if kernel_runs else ("xla",)
  out = []
  for compute in computes:
    out.append(schedule_lib.Schedule(dataflow="none", compute=compute))
    out.append(schedule_lib.Schedule(dataflow="direct", compute=compute))
    if dma:
      out.append(schedule_lib.Schedule(dataflow="direct", comm="dma",
                                       compute=compute))
  return tuple(out)
