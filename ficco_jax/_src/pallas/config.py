"""The Hopper kernel's tile config, and how one is chosen for a shape.

`ChunkMatmulConfig` holds the tiles of the Mosaic GPU kernel (`hopper.py`);
it is frozen, so it can be a jit static argument. `default_config` is the
heuristic used when a caller gives none. The kernel does not mask partial
tiles, so a config must divide the problem exactly (`check_shapes`): a CTA
tile past a chunk's last row would be TMA-stored over the next chunk's rows.

`pad_k` zero-pads x's K up to a multiple of the kernel's full-depth step,
and `flag_target` is the value a piece's flag reaches in the flagged kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

# Dtypes the Hopper kernel's wgmma takes straight from shared memory.
MGPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# What the chunk kernels (Hopper's and the interpreter's) read and write.
KERNEL_DTYPES = MGPU_DTYPES + (jnp.dtype(jnp.float32),)
# Shared memory a CTA may use on Hopper (227 KiB), less room for barriers.
SMEM_BUDGET = 227 * 1024 - 1024

Dim = Literal["m", "n"]


def grouped_operands_unfit(dtype, *dims: tuple[str, int, int]) -> str | None:
  """Why the grouped kernels (`grouped_hopper` and jax's) cannot take
  operands of ``dtype`` with each ``(name, size, tile)`` of ``dims``, or
  None: the dtype first, then the first size its tile does not divide."""
  if jnp.dtype(dtype) not in MGPU_DTYPES:
    return f"operands are {jnp.dtype(dtype)}, the kernel takes bf16 or f16"
  for name, size, tile in dims:
    if size % tile:
      return f"{name}={size} is not a multiple of {tile}"
  return None


def hopper_kernel_runs(device, dtype) -> bool:
  """Whether ficco's Mosaic GPU kernels (wgmma) run on ``device`` with
  ``dtype`` operands: a Hopper (sm_90) GPU and 2-byte operands."""
  if getattr(device, "platform", None) != "gpu":
    return False
  cc = str(getattr(device, "compute_capability", "") or "")
  try:
    major = int(cc.split(".")[0])
  except ValueError:
    return False
  # wgmma is sm_90a's: Blackwell (sm_100+) has no such instruction.
  return major == 9 and jnp.dtype(dtype) in MGPU_DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkMatmulConfig:
  """Tiles of the Hopper kernel. Frozen, so it can be a jit static argument.

  A CTA runs two compute warpgroups and one memory warpgroup. Each compute
  warpgroup owns a ``tile_m x tile_n`` f32 accumulator; the two are placed
  side by side along ``wg_dimension``, so a CTA's output tile is
  ``(2 * tile_m) x tile_n`` (``"m"``) or ``tile_m x (2 * tile_n)`` (``"n"``).

  Attributes:
    tile_m: rows of one warpgroup's accumulator (multiple of 64).
    tile_n: columns of one warpgroup's accumulator (multiple of 64, at most 256).
    tile_k: depth of one pipeline step (its bytes per row must be a TMA swizzle:
      32, 64 or 128 bytes, i.e. 64 for bf16/f16, or 32 when K is not a
      multiple of 64).
    max_concurrent_steps: pipeline stages in shared memory.
    epi_tile_m, epi_tile_n: the epilogue stores the accumulator in sub-tiles of
      this size, double buffered, so the TMA store of one overlaps the next.
    wg_dimension: which dimension the two compute warpgroups split.
    grid_minor_dim: the faster-moving dimension of the tile order.
    grid_tile_width: width of the bands of the snake tile order (L2 reuse).
  """

  # Defaults: the 128x256 CTA tile (two 64x256 warpgroup tiles) that was best
  # or tied on the H200 for the llama3-70b chunks.
  tile_m: int = 64
  tile_n: int = 256
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  wg_dimension: Dim = "m"
  grid_minor_dim: Dim = "n"
  grid_tile_width: int = 1

  def __post_init__(self):
    for name in ("tile_m", "tile_n", "tile_k", "max_concurrent_steps",
                 "epi_tile_m", "epi_tile_n", "grid_tile_width"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int.")
    if self.tile_m % 64:
      raise ValueError(f"{self.tile_m=} must be a multiple of 64 (wgmma M).")
    if self.tile_n % 64 or self.tile_n > 256:
      # 64: the (8, 64) tiling of the 128-byte-swizzled w tile in SMEM.
      raise ValueError(f"{self.tile_n=} must be a multiple of 64, at most 256.")
    if self.tile_m % self.epi_tile_m:
      raise ValueError(f"{self.epi_tile_m=} must divide {self.tile_m=}.")
    if self.tile_n % self.epi_tile_n:
      raise ValueError(f"{self.epi_tile_n=} must divide {self.tile_n=}.")
    if self.wg_dimension not in ("m", "n"):
      raise ValueError(f"{self.wg_dimension=} must be 'm' or 'n'.")
    if self.grid_minor_dim not in ("m", "n"):
      raise ValueError(f"{self.grid_minor_dim=} must be 'm' or 'n'.")

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (2 if self.wg_dimension == "m" else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (2 if self.wg_dimension == "n" else 1)

  def smem_bytes(self, in_dtype, out_dtype) -> int:
    """Shared memory one CTA allocates (pipeline stages + epilogue buffers)."""
    isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    stage = (self.cta_tile_m + self.cta_tile_n) * self.tile_k * isz
    slots = min(2, (self.tile_m * self.tile_n) // (self.epi_tile_m * self.epi_tile_n))
    return (self.max_concurrent_steps * stage
            + 2 * slots * self.epi_tile_m * self.epi_tile_n * osz)

  def check_shapes(self, mc: int, n: int, k: int) -> None:
    """Raises ValueError unless the tiles divide the problem exactly."""
    # The Hopper kernel does not mask: a CTA tile that ran past row mc would be
    # TMA-stored over the rows of the next chunk of ``out``, so tiles must
    # divide the chunk exactly.
    if mc % self.cta_tile_m:
      raise ValueError(
          f"mc={mc} (rows of x) must be a multiple of the CTA tile's rows"
          f" {self.cta_tile_m} for config {self}.")
    if n % self.cta_tile_n:
      raise ValueError(
          f"n={n} (columns of w) must be a multiple of the CTA tile's columns"
          f" {self.cta_tile_n} for config {self}.")
    if k % self.tile_k:
      raise ValueError(f"K={k} must be a multiple of {self.tile_k=}.")


# CTA tile shapes the heuristic weighs, as (tile_m, tile_n, wg_dimension) per
# warpgroup, with their throughput relative to the 128x256 tile when every SM
# is busy: smaller tiles re-read more operand bytes per flop. The first four
# are read off an H200 sweep (the ``kernel`` benchmark suite); the 64-row ones
# are guesses that only matter for chunks no larger tile divides.
_CANDIDATES = (
    (64, 256, "m", 1.0),    # CTA 128x256
    (128, 128, "m", 0.97),  # CTA 256x128
    (64, 192, "m", 0.95),   # CTA 128x192
    (64, 128, "m", 0.87),   # CTA 128x128
    (64, 64, "m", 0.6),     # CTA 128x64
    (64, 128, "n", 0.6),    # CTA 64x256
    (64, 64, "n", 0.45),    # CTA 64x128
)


def default_config(mc: int, k: int, n: int, in_dtype=jnp.bfloat16,
                   out_dtype=jnp.bfloat16,
                   num_sms: int = 132) -> ChunkMatmulConfig:
  """The config used when none is given (``config=None``).

  Order: an explicit ``config`` argument wins (in ``chunk_matmul_into``);
  otherwise this heuristic. Among the CTA tiles of ``_CANDIDATES`` whose tiles
  divide the shape, it picks the one with the least estimated time
  ``ceil(tiles / num_sms) * tile_area / relative_throughput``: the kernel runs
  in whole waves of ``num_sms`` tiles, so a tile that leaves most of the last
  wave empty (e.g. 192 tiles of 128x256 on 132 SMs) loses to a smaller one
  that fills the waves. Then the most pipeline stages (<= 4) that fit in
  shared memory.

  Raises:
    ValueError: if no candidate divides the shape (mc not a multiple of 64
      (128 for most tiles), n not a multiple of 64 / 128, K not a multiple
      of 32 for 2-byte dtypes).
  """
  # 128-byte swizzle rows; a K that is not a multiple of them (qwen2-72b's
  # 29568 / 4 = 7392 = 115.5 x 64) takes 64-byte rows, at half the depth
  # per pipeline step: 20-25% slower on an H100. Callers that can afford a
  # copy of x pad it with pad_k instead (the reduce-scatter does).
  tile_k = 128 // jnp.dtype(in_dtype).itemsize
  if k % tile_k:
    tile_k //= 2
  k_iters = max(1, k // tile_k)
  best, best_cost = None, math.inf
  for tm, tn, wg, rel in _CANDIDATES:
    for steps in (4, 3, 2):
      cfg = ChunkMatmulConfig(
          tile_m=tm, tile_n=tn, tile_k=tile_k,
          max_concurrent_steps=min(steps, k_iters), epi_tile_m=64,
          epi_tile_n=64, wg_dimension=wg, grid_minor_dim="n",
          grid_tile_width=1)
      if (mc % cfg.cta_tile_m or n % cfg.cta_tile_n or k % cfg.tile_k
          or cfg.smem_bytes(in_dtype, out_dtype) > SMEM_BUDGET):
        continue
      tiles = (mc // cfg.cta_tile_m) * (n // cfg.cta_tile_n)
      cost = (math.ceil(tiles / num_sms) * cfg.cta_tile_m * cfg.cta_tile_n
              / rel)
      if cost < best_cost:
        best, best_cost = cfg, cost
      break  # Most stages that fit.
  if best is None:
    raise ValueError(
        f"No Hopper tile config divides mc={mc}, n={n}, K={k}: the kernel"
        f" needs mc and n multiples of 64 and K a multiple of {tile_k} (it"
        " does not mask partial tiles). Use compute='xla' for this shape.")
  return best


def flag_target(config: ChunkMatmulConfig, piece_rows: int, n: int,
                num_ctas: int, bump: str = "piece_end") -> int:
  """A piece's flag once the flagged kernel has written it: one bump per
  compute warpgroup (2) per CTA that has tiles in the piece (``piece_end``:
  a piece's tiles are a run of consecutive tile indices, dealt round-robin
  to ``num_ctas`` CTAs), or per CTA tile of the piece (``tile``)."""
  tiles = (piece_rows // config.cta_tile_m) * (n // config.cta_tile_n)
  return 2 * (tiles if bump == "tile" else min(tiles, num_ctas))


def padded_k(k: int) -> int:
  """The columns `pad_k` gives an operand of ``k`` columns."""
  return k if k % 64 == 0 or k % 8 else -(-k // 64) * 64


def pad_k(x: jax.Array) -> jax.Array:
  """``x [..., K]`` with zero columns up to a multiple of 64, for the Hopper
  kernel's 16-bit dtypes and K % 8 == 0 (16-byte rows).

  Why: Mosaic GPU tiles an operand in GMEM as it tiles shared memory, so the
  Hopper kernel's x needs K a multiple of its 64-deep steps; otherwise it
  falls back to 32-deep steps throughout, 20-25% slower on an H100. One
  padding copy of x (and none of w: TMA fills w's rows past K with zeros)
  buys full-depth steps for a K such as qwen2-72b's 29568 / 4 = 7392.
  Returns ``x`` itself when no padding applies (K a multiple of 64 or not of
  8, or a dtype the Hopper kernel does not take).
  """
  k = x.shape[-1]
  if padded_k(k) == k or jnp.dtype(x.dtype) not in MGPU_DTYPES:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded_k(k) - k)])
