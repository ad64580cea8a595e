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


def choose_schedule(op: str, *, x_shape, w_shape, dtype, axis_size: int,
                    axis: int = 0,
                    platform: str | None = None) -> schedule_lib.Schedule:
  """The schedule ``schedule=None`` resolves to, from static sizes.

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    x_shape: the local (per-device) shape of the op's first operand (``x``
      or ``h``), as the op sees it inside ``shard_map``.
    w_shape: the local shape of ``w``.
    dtype: element type of the first operand.
    axis_size: devices along the axis.
    axis: ``gather_axis`` or ``scatter_axis``.
    platform: ``jax.default_backend()`` when None.

  Returns:
    A schedule; `schedule_lib.NO_OVERLAP` where overlap would not pay.
  """
  if op not in ("all_gather_matmul", "matmul_reduce_scatter"):
    raise ValueError(f"Unknown {op=}.")
  del w_shape  # Used by the measured model (see explain); not by this rule.
  size = int(np.prod(x_shape))
  rows = x_shape[axis]
  row_elems = size // max(rows, 1)
  if op == "matmul_reduce_scatter":
    rows //= axis_size  # The rows each device keeps.
  platform = platform or jax.default_backend()
  moved = rows * row_elems * np.dtype(dtype).itemsize * (axis_size - 1)
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
    if rows % c == 0 and rows // c >= MIN_CHUNK_ROWS:
      chunks = c
      break
  return schedule_lib.Schedule(dataflow="direct", num_chunks=chunks,
                               comm="dma", compute="xla")
