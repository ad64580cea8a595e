"""The heuristic behind ``schedule=None``: the cost model's fastest candidate.

Gates first (each makes the answer `schedule_lib.NO_OVERLAP` without asking
the model), then the model (`cost_model`) ranks every valid candidate and
overlap is chosen only when it is predicted `cost_model.MIN_GAIN` faster than
no overlap (`cost_model.UNCALIBRATED_MIN_GAIN` where no fitted calibration
applies). The autotune cache, when it has an entry, takes precedence over
this (`ficco_jax._src.resolve`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax.numpy as jnp
import numpy as np

from ficco_jax._src import devices
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src.tuning import cost_model
from ficco_jax._src.tuning import device_params

log = logging.getLogger("ficco_jax")

# Below this many bytes gathered per device, a collective takes a few
# microseconds and the fixed cost of splitting the matmul is larger than
# anything overlap could hide.
MIN_OVERLAP_BYTES = 4 << 20

# The one switch for overlapping matmul_reduce_scatter by default. The
# shard-level ppermute overlap is slower than no overlap on 4xH200, so only
# the copy-engine (comm="dma") reduce-scatter can win, and it does on most
# shapes. While off, schedule=None never overlaps the reduce-scatter (an
# explicit schedule, or an autotune-cache entry, still does).
OVERLAP_REDUCE_SCATTER = True

# Engines the heuristic ranks. comm='xla' (ppermute) is kept: its measured
# contention makes the model reject it on GPUs, as the measurements did.
COMMS = ("dma", "xla")

NO_DMA_LIBRARY = "the copy-engine (CUDA) library is not built into this install"


@functools.lru_cache(maxsize=None)
def dma_available(platform: str) -> bool:
  """Whether comm='dma' runs on ``platform`` in this process."""
  if platform not in ("cuda", "gpu"):
    return False
  try:
    from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
    return library.cuda_compiled()
  except ImportError:
    return False


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
  """Logs ``message`` as a warning the first time it is seen."""
  log.warning(message)


def gate(op: str, *, x_shape, dtype, axis_size: int, axis: int,
         platform: str) -> str | None:
  """Why the answer is no overlap without consulting the model (None: ask it)."""
  size = int(np.prod(x_shape))
  rows = x_shape[axis]
  row_elems = size // max(rows, 1)
  if op == "matmul_reduce_scatter":
    rows //= axis_size  # The rows each device keeps.
  moved = rows * row_elems * np.dtype(dtype).itemsize * (axis_size - 1)
  if axis_size == 1 or moved < MIN_OVERLAP_BYTES:
    return (f"tiny: {moved} bytes move per device (< {MIN_OVERLAP_BYTES}),"
            " too little to hide")
  if platform not in ("cuda", "gpu"):
    # Off GPUs there are no copy engines to overlap with, and XLA's own
    # collective + dot is the fastest portable form.
    return f"platform {platform!r} has no copy engines to overlap with"
  if op == "matmul_reduce_scatter" and not OVERLAP_REDUCE_SCATTER:
    return ("the reduce-scatter is not overlapped by default yet"
            " (heuristics.OVERLAP_REDUCE_SCATTER)")
  if not dma_available(platform):
    return NO_DMA_LIBRARY
  return None


def pallas_fits(op: str, schedule: schedule_lib.Schedule, *, x_shape,
                w_shape, dtype, axis_size: int, axis: int) -> bool:
  """Whether every piece of ``schedule`` suits the Hopper kernel at full
  depth: 16-bit operands, CTA tiles dividing every piece's rows and the
  output columns, and K a multiple of 64. Other K run full-depth steps on
  h zero-padded once per op (`chunk_matmul.pad_k`, the reduce-scatter's
  only), which on qwen2-72b runs level with XLA's dot pieces on 4xH200, so
  the heuristic keeps XLA's."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False
  from ficco_jax._src.pallas import chunk_matmul  # pylint: disable=g-import-not-at-top

  # The rows of one device's share: the reduce-scatter's operand holds every
  # rank's rows, the all-gather's only its own shard.
  m = x_shape[axis]
  if op == "matmul_reduce_scatter":
    m //= axis_size
  fold = math.prod(d for i, d in enumerate(x_shape[:-1]) if i != axis)
  mc = m // schedule.num_chunks
  rows = {m, mc}
  if schedule.dataflow == "bidirectional":
    rows = {mc // 2, mc - mc // 2} - {0}
  k, n = x_shape[-1], w_shape[-1]
  try:
    for r in rows:
      if chunk_matmul.default_config(r * fold, k, n).tile_k != 64:
        return False
  except ValueError:
    return False
  return True


# The push all-gather (Schedule docs, compute_granularity="flagged").
PUSH_GATHER = schedule_lib.Schedule(dataflow="direct", num_chunks=1,
                                    comm="dma",
                                    compute_granularity="flagged")


def decide(op: str, *, x_shape, w_shape, dtype, axis_size: int, axis: int,
           platform: str, params: device_params.DeviceParams,
           assume_dma: bool = False, processes: int = 1,
           comms: tuple[str, ...] = COMMS
           ) -> tuple[schedule_lib.Schedule, str]:
  """The heuristic's choice and, in words, why.

  Args:
    op, x_shape, w_shape, dtype, axis_size, axis, platform: as for
      `heuristic_schedule`.
    params: the cost model's constants for the target device.
    assume_dma: plan as if the copy-engine library were available
      (``ficco_jax.explain`` for a device kind that is not at hand).
    processes: the job's process count (``jax.process_count()`` for the
      devices at hand).
    comms: the engines ranked (``("xla",)`` for a call that cannot run the
      copy engines).

  Returns:
    ``(schedule, reason)``.
  """
  reason = gate(op, x_shape=x_shape, dtype=dtype, axis_size=axis_size,
                axis=axis, platform=platform)
  if reason == NO_DMA_LIBRARY and not assume_dma:
    # Not in silence: the user installed without nvcc and gets XLA's
    # program where a faster one exists.
    warn_once(
        "ficco_jax: the copy-engine (CUDA) library is not built into this"
        " install, so schedule=None uses XLA's all-gather + dot without"
        " overlap. Reinstall with nvcc on PATH to enable comm='dma'.")
  if reason is not None and not (assume_dma and reason == NO_DMA_LIBRARY):
    return schedule_lib.NO_OVERLAP, reason
  prob = cost_model.problem(op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
                            axis_size=axis_size, axis=axis)
  preds = cost_model.rank(prob, params, comms=comms)
  allowed = lambda s: cost_model.eligible(params, op, s, axis_size)  # noqa: E731
  margin = cost_model.min_gain_for(params, axis_size, op)
  chosen = cost_model.best(preds, min_gain=margin, allowed=allowed)
  none = next(pr for pr in preds if not pr.schedule.overlapped)
  gain = 1 - chosen.total / none.total
  if chosen.schedule.overlapped:
    reason = (f"lowest predicted time, {100 * gain:.1f}% faster than no"
              " overlap")
    schedule = chosen.schedule
    if (schedule.comm == "dma" and params.pieces_on_pallas(op, axis_size)
        and pallas_fits(op, schedule, x_shape=x_shape, w_shape=w_shape,
                        dtype=dtype, axis_size=axis_size, axis=axis)):
      # The model times XLA's dot; the kernel measured faster for this op
      # on this device kind (DeviceParams.pallas_pieces), so the pieces
      # run on it.
      schedule = dataclasses.replace(schedule, compute="pallas")
      reason += ("; pieces on ficco's Pallas kernel (measured faster than"
                 " XLA's dot for this op on this device kind)")
    if (op == "all_gather_matmul" and schedule.comm == "dma"
        and schedule.num_chunks == 1):
      if processes > 1 and schedule.dataflow == "direct":
        # Across processes a pulled shard must first be staged into the
        # window (the window transport), on the critical path of every
        # peer; the push all-gather copies it straight from XLA's buffer
        # into the peers' windows and multiplies it there. In one process
        # the two are level at P = 2, and the rendezvous path keeps its
        # Pallas pieces.
        schedule = PUSH_GATHER
        reason += ("; as the push all-gather (direct/c1/dma/xla/flagged):"
                   " the axis spans processes, where pulled shards would be"
                   " staged first")
      elif (processes == 1 and axis_size in params.push_gather_at
            and schedule.dataflow in ("direct", "ring")):
        # The pulled gathers start their copies in a host rendezvous of
        # every peer; the push all-gather's GEMMs wait on the device
        # (DeviceParams.push_gather_at says where that measured faster).
        schedule = PUSH_GATHER
        reason += ("; as the push all-gather (direct/c1/dma/xla/flagged),"
                   " measured faster than the pulled gathers at this axis"
                   " size on this device kind")
    return schedule, reason
  top = next(pr for pr in preds if allowed(pr.schedule))
  if top.schedule.overlapped:
    return chosen.schedule, (
        f"best overlap ({top.schedule.short()}) is predicted only"
        f" {100 * (1 - top.total / none.total):.1f}% faster than no overlap"
        f" (needs {100 * margin:.0f}%"
        + ("" if margin == cost_model.MIN_GAIN else
           ": no fitted calibration applies here") + ")")
  return chosen.schedule, "no overlapped schedule is predicted faster"


def heuristic_schedule(op: str, *, x_shape, w_shape, dtype, axis_size: int,
                       axis: int = 0, platform: str | None = None,
                       device_kind: str | None = None,
                       params: device_params.DeviceParams | None = None
                       ) -> schedule_lib.Schedule:
  """The heuristic's pick alone (step 3 of `ficco_jax._src.resolve`'s
  order; `ficco_jax.choose_schedule` consults the autotune cache first).

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    x_shape: the local shape of the op's first operand.
    w_shape: the local shape of ``w``.
    dtype: element type of the first operand.
    axis_size: devices along the axis.
    axis: ``gather_axis`` or ``scatter_axis``.
    platform: the traced devices' platform when None.
    device_kind: the GPU to plan for; the traced devices' kind when None.
    params: cost-model constants; `device_params.params_for(device_kind)`
      when None.

  Returns:
    ``"none"``, or an overlapped schedule over `COMMS` whose ``num_chunks``
    divides the split dimension.
  """
  if op not in cost_model.OPS:
    raise ValueError(f"Unknown {op=}.")
  platform = platform or devices.platform()
  params = params or device_params.params_for(
      device_kind or devices.device_kind())
  return decide(op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
                axis_size=axis_size, axis=axis, platform=platform,
                params=params)[0]
