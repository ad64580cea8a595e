"""Default schedule choice when the caller passes ``schedule=None``."""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np

from ficco_jax._src import schedule as schedule_lib

log = logging.getLogger("ficco_jax")

# Below this many bytes gathered per device, a collective takes a few
# microseconds and the fixed cost of splitting the matmul is larger than
# anything overlap could hide.
MIN_OVERLAP_BYTES = 4 << 20
# Pieces below this many rows make the matmul noticeably less efficient.
MIN_CHUNK_ROWS = 1024


@functools.lru_cache(maxsize=None)
def dma_available(platform: str) -> bool:
  """Whether comm='dma' runs on ``platform`` in this process."""
  if platform not in ("cuda", "gpu"):
    return False
  try:
    from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return library.cuda_compiled()


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  log.warning(message)


def choose_schedule(op: str, *, shard_rows: int, row_elems: int, n: int,
                    dtype, axis_size: int,
                    platform: str | None = None) -> schedule_lib.Schedule:
  """Picks a schedule from static sizes.

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    shard_rows: rows of the local operand along the gathered/scattered axis
      (for the reduce-scatter, rows of its output shard).
    row_elems: elements per row of the operand that moves.
    n: columns of the weight.
    dtype: element type of the moving operand.
    axis_size: devices along the axis.
    platform: ``jax.default_backend()`` when None.

  Returns:
    A schedule; `schedule_lib.NO_OVERLAP` where overlap would not pay.
  """
  del n  # Used by the measured model (see explain); not by this rule.
  platform = platform or jax.default_backend()
  moved = shard_rows * row_elems * np.dtype(dtype).itemsize * (axis_size - 1)
  if axis_size == 1 or moved < MIN_OVERLAP_BYTES:
    return schedule_lib.NO_OVERLAP
  if platform not in ("cuda", "gpu"):
    # Off GPUs there are no copy engines to overlap with, and XLA's own
    # collective + dot is the fastest portable form.
    return schedule_lib.NO_OVERLAP
  if op == "matmul_reduce_scatter":
    # Shard-level ppermute overlap measured slower than no overlap on the
    # 4xH200 NVSwitch machine; the DMA reduce-scatter is not built yet.
    return schedule_lib.NO_OVERLAP
  if not dma_available(platform):
    _warn_once(
        "ficco_jax: the copy-engine (CUDA) library is not built into this"
        " install, so schedule=None uses XLA's all-gather + dot without"
        " overlap. Reinstall with nvcc on PATH to enable comm='dma'."
    )
    return schedule_lib.NO_OVERLAP
  chunks = 1
  for c in (4, 2):
    if shard_rows % c == 0 and shard_rows // c >= MIN_CHUNK_ROWS:
      chunks = c
      break
  return schedule_lib.Schedule(dataflow="direct", num_chunks=chunks,
                               comm="dma", compute="xla")
