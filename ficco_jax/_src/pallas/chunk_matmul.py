"""Chunk matmul that writes its product in place into rows of a larger output.

``chunk_matmul_into(out, x, w, row_offset)`` computes ``x [mc, K] @ w [K, n]``
and stores it into rows ``[row_offset, row_offset + mc)`` of ``out [M, n]``;
``out`` is aliased to the result (``input_output_aliases``), so XLA emits no
copy and no ``dynamic_update_slice`` after the kernel, and the other rows of
``out`` are left as they were. This is the compute step of the overlapped
collective matmuls: chunk ``c`` of the gathered operand is multiplied straight
into its place in the gathered output while chunk ``c + 1`` is still in flight.

Two formulations:

* **portable** (``_kernel``): a ``pl.pallas_call`` over a ``(mc // bm, n // bn)``
  grid with BlockSpecs for ``x``/``w`` and the output left in place
  (``pl.ANY``), written at a dynamic row offset read from a scalar operand. It
  runs under ``interpret=True`` on CPU, which is how CI tests the chunk/offset
  logic.
* **Hopper** (``_mgpu_kernel``): a Mosaic GPU kernel, warp specialized (one
  warpgroup issues TMA loads, two issue ``wgmma``), persistent over a grid of at
  most ``num_sms`` CTAs that loop over the output tiles of the chunk. The
  epilogue TMA-stores each tile at ``row_offset + tile row`` of the full output
  (a TMA descriptor over all of ``out``, dynamic coordinates), so the dynamic
  offset costs nothing.

``interpret=None`` picks: interpret mode on CPU, the Hopper kernel on GPU.

Hopper-path constraints (checked, with a ValueError/TypeError naming the
argument): bf16/f16 operands (f32 operands only in interpret mode); the CTA
tile must divide the chunk exactly -- mc and n multiples of 64 (128 for most
tiles), K a multiple of 64 -- because a partial tile would be TMA-stored over
the next chunk's rows (no masking); ``row_offset`` a multiple of 8. Mosaic
GPU tiles the GMEM operand as it tiles shared memory, so x's K must be a
multiple of the step depth: other K take half-depth steps, or a zero-padded
x (`pad_k`, ``x_zero_padded_k``) with w read past its rows (TMA fills
zeros). On an H200 the kernel matches or beats cuBLAS (XLA's dot) on the
llama3/gpt3 chunk shapes with mc >= 512 (the ``kernel`` benchmark suite).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Dtypes the Hopper kernel's wgmma takes straight from shared memory.
_MGPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared memory a CTA may use on Hopper (227 KiB), less room for barriers.
_SMEM_BUDGET = 227 * 1024 - 1024

Dim = Literal["m", "n"]


# ----------------------------------------------------------------------------
# Config.


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
          or cfg.smem_bytes(in_dtype, out_dtype) > _SMEM_BUDGET):
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


# ----------------------------------------------------------------------------
# Offsets that are a function of the device's rank.


@dataclasses.dataclass(frozen=True)
class ByRank:
  """Piece offsets that depend only on this device's rank along a mesh axis.

  ``table[r]`` lists the offsets (one per piece) that rank ``r`` uses;
  ``rank`` is the traced rank (``lax.axis_index``, or the flagged
  reduce-scatter's `peer_copy.arm` rank, which spares the program XLA's
  partition-id). The Hopper kernel
  compiles the table in and reads only the rank at run time: every Pallas
  call of an op takes the same one-element operand, which XLA computes once
  (compiled HLO of a reduce-scatter: one ``partition-id``, one operand for
  its four kernels), instead of an offsets array per call, each its own
  tiny kernel launch (4 to 7 per reduce-scatter, ~1 us of device and
  several us of host time each, in a profile on 4xH200).

  Attributes:
    rank: int32 scalar, this device's rank in ``[0, len(table))``.
    table: per rank, one static offset per piece.
  """

  rank: Any
  table: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    table = tuple(tuple(int(v) for v in row) for row in self.table)
    if not table or len({len(row) for row in table}) != 1 or not table[0]:
      raise ValueError(
          f"ByRank.table must have one non-empty row per rank, all of one"
          f" length; got row lengths {[len(r) for r in table]}.")
    object.__setattr__(self, "table", table)

  def __len__(self) -> int:
    return len(self.table[0])

  def traced(self) -> list[jax.Array]:
    """This rank's offsets as traced int32 scalars (portable paths)."""
    t = jnp.asarray(np.asarray(self.table, np.int32))
    return [t[self.rank, i] for i in range(len(self))]


# ----------------------------------------------------------------------------
# Reference.


def _reference(out, x, w, row_offset):
  """XLA reference: f32-accumulated dot, then dynamic_update_slice into out."""
  y = lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                      preferred_element_type=jnp.float32)
  row_offset = jnp.asarray(row_offset, jnp.int32)
  return lax.dynamic_update_slice(out, y.astype(out.dtype),
                                  (row_offset, jnp.int32(0)))


# ----------------------------------------------------------------------------
# Validation.


def _check_args(out, x, w, row_offset, preferred_element_type):
  for name, a in (("out", out), ("x", x), ("w", w)):
    if getattr(a, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(a, 'shape', None)}.")
    if jnp.dtype(a.dtype) not in _DTYPES:
      raise TypeError(
          f"{name}.dtype={a.dtype} must be one of bfloat16, float16, float32.")
  mc, k = x.shape
  k2, n = w.shape
  m, n2 = out.shape
  if k != k2:
    raise ValueError(
        f"x.shape={x.shape} and w.shape={w.shape}: the contracting dimension"
        f" K must match ({k} != {k2}).")
  if n != n2:
    raise ValueError(
        f"out.shape={out.shape} must have w's {n} columns (w.shape={w.shape}).")
  if mc > m:
    raise ValueError(f"x has mc={mc} rows, more than out's M={m} rows.")
  if x.dtype != w.dtype:
    raise TypeError(f"x.dtype={x.dtype} and w.dtype={w.dtype} must match.")
  if (preferred_element_type is not None
      and jnp.dtype(preferred_element_type) != jnp.dtype(out.dtype)):
    raise TypeError(
        f"preferred_element_type={jnp.dtype(preferred_element_type)} must be"
        f" None or out.dtype={out.dtype}: the product is written into out.")
  if isinstance(row_offset, (int, np.integer)) and not isinstance(row_offset, bool):
    if not 0 <= row_offset <= m - mc:
      raise ValueError(
          f"row_offset={row_offset} with mc={mc} rows must lie in [0, {m - mc}]"
          f" so that rows [row_offset, row_offset + mc) fit in out's M={m}.")
  else:
    dt = getattr(row_offset, "dtype", None)
    if (isinstance(row_offset, bool) or dt is None
        or not jnp.issubdtype(dt, jnp.integer) or jnp.ndim(row_offset) != 0):
      raise TypeError(
          f"row_offset must be an int or an integer scalar array, got"
          f" {type(row_offset).__name__} with dtype={dt},"
          f" shape={getattr(row_offset, 'shape', None)}.")


def _check_num_sms(num_sms) -> None:
  if num_sms is not None and (
      isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
    raise ValueError(f"num_sms={num_sms!r} must be None or a positive int.")


def _offset_operand(row_offset, x_row_offset=0) -> jax.Array:
  """The offsets of one piece: see `_offsets`."""
  return _offsets([row_offset], [x_row_offset])


def _offsets(out_rows, x_rows) -> jax.Array:
  # A (2 * pieces,) int32 operand: the first row each piece is written at in
  # out, then the first row each piece is read from in x. The kernels read
  # it at run time, so traced offsets (e.g. from lax.axis_index) compile once
  # for all devices.
  return jnp.stack([jnp.asarray(r, jnp.int32)
                    for r in (*out_rows, *x_rows)])


# ----------------------------------------------------------------------------
# Portable formulation (interpret mode on CPU).


def _out_type_like(out) -> jax.ShapeDtypeStruct:
  return _out_type(out.shape, out.dtype, like=(out,))


def _invariant_out_type(shape, dtype) -> jax.ShapeDtypeStruct:
  """A result typed as varying over no mesh axis, explicitly (jax >= 0.11
  under check_vma demands a type): a fresh constant's type, in any jax."""
  mat = getattr(jax.typeof(jnp.zeros((), jnp.int32)), "manual_axis_type", None)
  if mat is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  return jax.ShapeDtypeStruct(shape, dtype)


def _out_type(shape, dtype, *, like) -> jax.ShapeDtypeStruct:
  # Inside shard_map with check_vma the result varies over the mesh axes that
  # out varies over (jax >= 0.10: manual_axis_type; older: vma). Note that
  # jax 0.10.2's Pallas interpreter rejects even trivial kernels under
  # check_vma=True ("requires varying manual axes to match"), so interpret
  # mode inside shard_map needs check_vma=False; the Hopper kernel does not.
  # ``like``: the operands the result is computed from; it varies over the
  # axes any of them varies over.
  avals = [jax.typeof(a) for a in like]
  typed = [a for a in avals if getattr(a, "manual_axis_type", None) is not None]
  if typed:
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=typed[0].manual_axis_type)
  vma = frozenset().union(*(getattr(a, "vma", None) or () for a in avals))
  if vma:
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
  return jax.ShapeDtypeStruct(shape, dtype)


def _largest_divisor_at_most(v: int, cap: int) -> int:
  for d in range(min(v, cap), 0, -1):
    if v % d == 0:
      return d
  return 1


def _kernel(off_ref, x_ref, w_ref, out_in_ref, out_ref, *, block_m, block_n):
  # off_ref:    (2,) int32, whole: [0] first row of the chunk inside out.
  # x_ref:      (block_m, K) block of x at (i, 0).
  # w_ref:      (K, block_n) block of w at (0, j).
  # out_in_ref: (M, n) all of out, unblocked (pl.ANY); aliased to out_ref and
  #             never read: it is here only to carry the aliasing.
  # out_ref:    (M, n) all of out, unblocked (pl.ANY); the product's block
  #             lands at rows off + i * block_m, columns j * block_n.
  del out_in_ref
  i, j = pl.program_id(0), pl.program_id(1)
  acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  rows = pl.ds(off_ref[0] + i * block_m, block_m)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
  out_ref[rows, cols] = acc.astype(out_ref.dtype)


def _portable_into(out, x, w, off, *, interpret):
  mc, k = x.shape
  n = w.shape[1]
  # Blocks need not be aligned in interpret mode; take the largest divisors so
  # any mc and n work without masking.
  block_m = _largest_divisor_at_most(mc, 128)
  block_n = _largest_divisor_at_most(n, 256)
  return pl.pallas_call(
      functools.partial(_kernel, block_m=block_m, block_n=block_n),
      out_shape=_out_type_like(out),
      grid=(mc // block_m, n // block_n),
      in_specs=[
          pl.BlockSpec(memory_space=pl.ANY),
          pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
          pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
          pl.BlockSpec(memory_space=pl.ANY),
      ],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      input_output_aliases={3: 0},
      name="ficco_chunk_matmul_into",
      interpret=interpret,
  )(off, x, w, out)


# ----------------------------------------------------------------------------
# Hopper formulation (Mosaic GPU, wgmma + TMA, persistent over <= num_sms CTAs).


def _device_num_sms() -> int:
  try:
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None:
      return abstract_device.num_cores
  except AttributeError:
    pass
  return getattr(jax.devices()[0], "core_count", None) or 1


def _mgpu_kernel(off_gmem, x_gmem, w_gmem, *rest, config, k_iters, mc,
                 pieces, rank_table=None, addend_rows=(), interpreted=False,
                 flagged=False, num_ctas=1, flag_walk="piece",
                 flag_bump="piece_end"):
  # off_gmem: (2 * pieces,) int32 GMEM: the first row of each piece inside
  #           out, then the first row of each piece inside x. The mc rows of
  #           the product are `pieces` equal pieces, each a whole number of
  #           CTA tiles, so a tile never straddles two. With `rank_table`
  #           (ByRank): (1,) int32, the rank, and rank r's offsets are
  #           rank_table[r] (compiled in).
  # x_gmem:   (>= mc, K) GMEM, TMA-loaded in (cta_tile_m, tile_k) blocks from
  #           its piece's x row on, so pieces of a larger operand need no
  #           gathering copy.
  # w_gmem:   (K, n) GMEM, TMA-loaded in (tile_k, cta_tile_n) blocks.
  # rest:     the addends, then out_gmem.
  # addends:  one GMEM array per entry of addend_rows; rows a0 + t of
  #           addend i (a0 = addend_rows[i]) are added, in f32, to row t of
  #           the product (its pieces stacked) before it is rounded and
  #           stored. Read straight into registers in the epilogue: the
  #           pipeline's shared memory is all taken by its stages.
  # out_gmem: (M, n) GMEM, all of out (aliased, or a fresh (mc, n) output);
  #           (epi_tile_m, epi_tile_n) sub-tiles are TMA-stored at row
  #           offset + tile row.
  # flagged:  rest holds flags_gmem (pieces,) int32 (aliased) before
  #           out_gmem: each compute warpgroup bumps a piece's flag once
  #           its stores of that piece are complete (flag_signal; see
  #           flag_bump), so a flag reaches flag_target(...) when its piece
  #           is written.
  # num_ctas: the grid (CTAs of the persistent loop): a CTA's tiles are
  #           lin, lin + num_ctas, ...
  # flag_walk: "piece": the tiles of piece 0 first, then piece 1, ..., and
  #           inside a piece the config's own walk (grid_minor_dim, width);
  #           "rows": one tile row after another over all pieces (for the
  #           kernel benchmark's comparison).
  # flag_bump: "piece_end": a CTA bumps a piece's flag once, at its last
  #           tile of that piece, after waiting for all of its stores (the
  #           wait covers every earlier tile's stores too), so a flag
  #           reaches 2 * min(tiles per piece, CTAs) (flag_target). Each bump
  #           is a system-scope release, which costs far more beside peer
  #           traffic than alone (one per tile makes the kernel 15-18%
  #           slower in the 4-GPU op, not on one GPU); this makes a few per
  #           CTA. "tile": every tile waits for its stores and bumps (for
  #           the kernel benchmark's comparison).
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.

  if flagged:
    from ficco_jax._src.pallas import flag_signal  # pylint: disable=g-import-not-at-top
    *addend_gmems, flags_gmem, out_gmem = rest

    def bump(piece):
      if interpreted:
        # jax's Mosaic GPU interpreter has no atomics and no rule for
        # flag_signal: each (CTA, compute warpgroup) counts into its own
        # slot of a (pieces, CTAs, 2) buffer, which _mgpu_into checks and
        # sums, so the tests check the bump logic on CPU.
        at = (piece, lax.axis_index("sm"), lax.axis_index("wg"))
        flags_gmem[at] = flags_gmem[at] + 1
      else:
        flag_signal.signal(flags_gmem, piece)
  else:
    *addend_gmems, out_gmem = rest

  dtype = x_gmem.dtype
  out_dtype = out_gmem.dtype
  n = w_gmem.shape[1]
  c = config
  tile_m, tile_n, tile_k = c.tile_m, c.tile_n, c.tile_k
  cta_tile_m, cta_tile_n = c.cta_tile_m, c.cta_tile_n
  m_iters, n_iters = mc // cta_tile_m, n // cta_tile_n
  epi_tile_m, epi_tile_n = c.epi_tile_m, c.epi_tile_n
  tiles_per_piece = m_iters // pieces

  swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  transforms = (plgpu.TilingTransform((8, swizzle_elems)),
                plgpu.SwizzleTransform(swizzle))
  # One epilogue slot suffices when a warpgroup has a single epilogue tile.
  num_out_slots = min(2, (tile_m * tile_n) // (epi_tile_m * epi_tile_n))
  out_swizzle = plgpu.find_swizzle(epi_tile_n * jnp.dtype(out_dtype).itemsize * 8)
  out_swizzle_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
  out_transforms = (plgpu.TilingTransform((8, out_swizzle_elems)),
                    plgpu.SwizzleTransform(out_swizzle))
  minor = 0 if c.grid_minor_dim == "m" else 1

  def get_pipeline(pipeline_body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        pipeline_body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((cta_tile_m, tile_k), lambda kk: (0, kk),
                            transforms=transforms, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tile_k, cta_tile_n), lambda kk: (kk, 0),
                            transforms=transforms, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=c.max_concurrent_steps,
        compute_context=compute_context,
    )

  # The bodies don't influence the allocations the pipeline needs.
  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
      out_smem=plgpu.SMEM((2, num_out_slots, epi_tile_m, epi_tile_n), out_dtype,
                          transforms=out_transforms),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg_idx = lax.axis_index("wg")
    if rank_table is None:
      off_at = lambda q: off_gmem[q]
    else:
      rank = off_gmem[0]

      def off_at(q):
        # A select chain over the ranks' compiled-in offsets (a few ranks).
        v = jnp.asarray(rank_table[0][q], jnp.int32)
        for r in range(1, len(rank_table)):
          v = jnp.where(rank == r, jnp.asarray(rank_table[r][q], jnp.int32), v)
        return v
    if pieces == 1:
      out_base, x_base = off_at(0), off_at(1)

    def tile_rows(m_idx):
      """First rows of tile row m_idx in out and in x."""
      if pieces == 1:
        piece_out, piece_x, within = out_base, x_base, m_idx
      else:
        # A short select chain over static indices: pieces <= 8 or so, and
        # it needs no dynamic scalar load.
        piece = m_idx // tiles_per_piece
        within = m_idx - piece * tiles_per_piece
        piece_out, piece_x = off_at(0), off_at(pieces)
        for q in range(1, pieces):
          hit = piece == q
          piece_out = jnp.where(hit, off_at(q), piece_out)
          piece_x = jnp.where(hit, off_at(pieces + q), piece_x)
      # The hint lets layout inference keep the (8, swizzle) tiling of
      # out_smem for TMA stores at a run-time row, and TMA loads at a
      # run-time row need the same proof; the wrappers require every
      # offset % 8 == 0.
      return (pl.multiple_of(piece_out + within * cta_tile_m, 8),
              pl.multiple_of(piece_x + within * cta_tile_m, 8))

    num_tiles = m_iters * n_iters
    piece_tiles = tiles_per_piece * n_iters
    piece_of = lambda lin: lin // piece_tiles  # Pieces are runs of lin.

    def ends_piece(lin):
      # The CTA's next tile is in another piece, or there is none.
      nxt = lin + num_ctas
      return (nxt >= num_tiles) | (piece_of(nxt) != piece_of(lin))

    @plgpu.nd_loop((num_tiles,), collective_axes="sm")
    def _mn_loop(info):
      # jax 0.10+ passes an NDLoopInfo; older versions a tuple of indices.
      (lin_idx,) = getattr(info, "index", info)
      if flagged and flag_walk == "piece":
        piece = piece_of(lin_idx)
        m_in, n_idx = plgpu.planar_snake(
            lin_idx - piece * piece_tiles, (tiles_per_piece, n_iters), minor,
            c.grid_tile_width)
        m_idx = piece * tiles_per_piece + m_in
      else:
        m_idx, n_idx = plgpu.planar_snake(
            lin_idx, (m_iters, n_iters), minor, c.grid_tile_width)
      out_row, x_row = tile_rows(m_idx)
      cta_m_slice = pl.ds(x_row, cta_tile_m)
      cta_n_slice = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      if c.wg_dimension == "m":
        wg_m_slice, wg_n_slice = pl.ds(wg_idx * tile_m, tile_m), slice(None)
      else:
        wg_m_slice, wg_n_slice = slice(None), pl.ds(wg_idx * tile_n, tile_n)

      def compute_context(eval_pipeline):
        @functools.partial(
            pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]
          if not addend_gmems:
            acc = acc.astype(out_dtype)
          # The chunk's rows start at a run-time offset inside out: the TMA
          # descriptor spans all of out and takes the offset as a coordinate.
          out_rows = pl.ds(out_row, cta_tile_m)
          out_tile = out_gmem.at[out_rows, cta_n_slice].at[wg_m_slice, wg_n_slice]
          # Let the previous tile's stores finish reading out_smem first.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for epi_mi in range(tile_m // epi_tile_m):
            for epi_ni in range(tile_n // epi_tile_n):
              epi_m = slice(epi_mi * epi_tile_m, (epi_mi + 1) * epi_tile_m)
              epi_n = slice(epi_ni * epi_tile_n, (epi_ni + 1) * epi_tile_n)
              slot = (epi_mi * (tile_n // epi_tile_n) + epi_ni) % 2
              # Double buffered: wait until at most one store is in flight.
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)
              tile = acc[epi_m, epi_n]
              if addend_gmems:
                r0 = m_idx * cta_tile_m + epi_mi * epi_tile_m
                c0 = n_idx * cta_tile_n + epi_ni * epi_tile_n
                if c.wg_dimension == "m":
                  r0 = r0 + wg_idx * tile_m
                else:
                  c0 = c0 + wg_idx * tile_n
                for a_gmem, a_row in zip(addend_gmems, addend_rows):
                  idx = (pl.ds(r0 + a_row, epi_tile_m), pl.ds(c0, epi_tile_n))
                  if interpreted:
                    # jax's Mosaic GPU interpreter has no rule for
                    # plgpu.load; a plain read of the same tile.
                    a_tile = a_gmem[idx]
                  else:
                    # Not "optimized": Mosaic GPU has no tiled transfer
                    # from GMEM into the wgmma layout, only element-wise
                    # loads (a plain read would demand the tiled one).
                    a_tile = plgpu.load(a_gmem, idx, optimized=False)
                  tile = tile + a_tile.astype(jnp.float32)
                tile = tile.astype(out_dtype)
              out_smem[wg_idx, slot] = tile
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot],
                                      out_tile.at[epi_m, epi_n])
          if flagged:
            # Complete in GMEM, not only read out of shared memory: the
            # copy engines read these rows once the flag says so.
            def publish():
              plgpu.wait_smem_to_gmem(0, wait_read_only=False)
              bump(piece_of(lin_idx))

            if flag_bump == "tile":
              publish()
            else:
              pl.when(ends_piece(lin_idx))(publish)

      def mma_body(_, x_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem.at[wg_m_slice], w_smem.at[:, wg_n_slice])
        plgpu.wgmma_wait(0)
        return acc_ref

      get_pipeline(mma_body, compute_context)(
          x_gmem.at[cta_m_slice, :],
          w_gmem.at[:, cta_n_slice],
          allocations=pipeline_allocs,
      )

  # Await all stores before the kernel exits.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def flag_target(config: "ChunkMatmulConfig", piece_rows: int, n: int,
                num_ctas: int, bump: str = "piece_end") -> int:
  """A piece's flag once the flagged kernel has written it: one bump per
  compute warpgroup (2) per CTA that has tiles in the piece (``piece_end``:
  a piece's tiles are a run of consecutive tile indices, dealt round-robin
  to ``num_ctas`` CTAs), or per CTA tile of the piece (``tile``)."""
  tiles = (piece_rows // config.cta_tile_m) * (n // config.cta_tile_n)
  return 2 * (tiles if bump == "tile" else min(tiles, num_ctas))


def _mgpu_into(out, x, w, off, *, num_sms, config, off_static=None,
               mosaic_interpret=None, rows=None, out_dtype=None,
               addends=(), addend_rows=(), fresh_rows=None, flags=None,
               flag_variant=("piece", "piece_end")):
  """The Hopper kernel: for each of the ``len(off) // 2`` pieces ``i`` of
  ``rows / pieces`` rows, ``x[off[P + i]:][:rows / P] @ w`` into rows
  ``off[i]:`` of ``out`` (aliased), or of a fresh ``[rows, n]`` array when
  ``out`` is None (every tile is written, so nothing needs zeroing first),
  or of a fresh ``[fresh_rows, n]`` array (rows no piece covers are left
  unwritten). ``off`` may be a `ByRank` of the same ``2 * pieces`` offsets
  per rank. Row ``t`` of the product (pieces stacked) gets
  ``addends[i][addend_rows[i] + t]`` added for every ``i``, in f32 before
  rounding."""
  # mosaic_interpret: tests only; jax's Mosaic GPU interpreter params, which
  # run this very kernel on CPU (simulated threads, TMA and wgmma).
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.

  # x may carry zero columns past w's K rows (pad_k): the kernel then runs
  # whole steps over x, and TMA zero-fills the rows of w past its end.
  k = x.shape[1]
  k_w = w.shape[0]
  if k != k_w and k != padded_k(k_w):
    raise ValueError(f"x.shape={x.shape} and w.shape={w.shape}: x must have"
                     f" K={k_w} columns, or padded_k(K) from pad_k.")
  mc = x.shape[0] if rows is None else rows
  n = w.shape[1]
  out_dtype = out.dtype if out is not None else out_dtype
  if jnp.dtype(x.dtype) not in _MGPU_DTYPES:
    raise TypeError(
        f"x.dtype={x.dtype}: the Hopper kernel takes bfloat16 or float16"
        " operands (wgmma from shared memory); use compute='xla' for float32.")
  device_sms = _device_num_sms()
  sms = min(num_sms, device_sms) if num_sms is not None else device_sms
  if mosaic_interpret and num_sms is not None:
    # The interpreter simulates as many SMs as asked for; the CPU device
    # reports none (so `device_sms` is 1 there, which would run one CTA).
    sms = num_sms
  rank_table = None
  if isinstance(off, ByRank):
    rank_table = off.table
    off = jnp.asarray(off.rank, jnp.int32).reshape(1)
  pieces = (off.shape[0] if rank_table is None else len(rank_table[0])) // 2
  piece_rows = mc // pieces
  if config is None:
    # Waves are counted over all the pieces' tiles; tiles must divide each.
    config = default_config(mc, k, n, x.dtype, out_dtype, num_sms=sms)
    if piece_rows % config.cta_tile_m:
      config = default_config(piece_rows, k, n, x.dtype, out_dtype,
                              num_sms=sms)
  elif not isinstance(config, ChunkMatmulConfig):
    raise TypeError(f"config must be a ChunkMatmulConfig, got {type(config)}.")
  config.check_shapes(piece_rows, n, k)
  flag_walk, flag_bump = flag_variant
  if flag_walk not in ("piece", "rows") or flag_bump not in ("piece_end",
                                                             "tile"):
    raise ValueError(f"flag_variant={flag_variant!r}: the walk is 'piece' or"
                     " 'rows', the bump 'piece_end' or 'tile'.")
  if flags is not None and out is not None:
    raise ValueError("flags need a fresh result (out=None).")
  if flags is not None and flag_walk == "rows":
    # Row-major bands of one tile row over all pieces.
    config = dataclasses.replace(config, grid_minor_dim="m",
                                 grid_tile_width=1)
  if isinstance(off_static, int) and off_static % 8:
    raise ValueError(
        f"row_offset={off_static} must be a multiple of 8 on the Hopper path"
        " (TMA transfers of 8-row tiled shared memory).")
  num_tiles = (mc // config.cta_tile_m) * (n // config.cta_tile_n)
  grid = min(sms, num_tiles)

  kernel = pl.kernel(
      functools.partial(_mgpu_kernel, config=config,
                        k_iters=k // config.tile_k, mc=mc, pieces=pieces,
                        rank_table=rank_table,
                        addend_rows=tuple(int(a) for a in addend_rows),
                        interpreted=bool(mosaic_interpret),
                        flagged=flags is not None, num_ctas=grid,
                        flag_walk=flag_walk, flag_bump=flag_bump),
      out_type=(() if out is not None
                # A fresh_rows result is written into by later calls (a
                # Ref), which jax >= 0.11 allows only typed invariant; the
                # caller restores its type (vma.vary_like).
                else _invariant_out_type((fresh_rows, n), out_dtype)
                if fresh_rows is not None
                else _out_type((mc, n), out_dtype, like=(x, w, off))),
      mesh=plgpu.Mesh(grid=(grid,), grid_names=("sm",),
                      num_threads=3, thread_name="wg"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="ficco_chunk_matmul_into",
      interpret=mosaic_interpret or False,
  )
  if flags is not None:
    target = flag_target(config, piece_rows, n, grid, flag_bump)
    if mosaic_interpret:
      # Per-(CTA, warpgroup) counts (see bump in _mgpu_kernel).
      counts_ref = jax.new_ref(jnp.zeros((pieces, grid, 2), jnp.int32))
      result = kernel(off, x, w, *addends, counts_ref)
      counts = jax.freeze(counts_ref)
      flags = flags + counts.sum((1, 2))
      if flag_bump == "piece_end":
        # Its contract is one bump per (CTA, warpgroup, piece): a second
        # would release the piece's copies before another CTA has stored
        # its tiles. Poison the flag so that the tests see it.
        flags = flags + 1000 * (counts > 1).sum((1, 2))
      return result, flags, target
    flags_ref = jax.new_ref(flags)
    result = kernel(off, x, w, *addends, flags_ref)
    return result, jax.freeze(flags_ref), target
  if out is None:
    return kernel(off, x, w, *addends)
  # A Ref operand is aliased in and out of the kernel (input_output_aliases
  # after discharge): the kernel writes the chunk's rows of out in place.
  out_ref = jax.new_ref(out)
  kernel(off, x, w, *addends, out_ref)
  return jax.freeze(out_ref)


# ----------------------------------------------------------------------------
# Public (in _src) entry points.


def padded_k(k: int) -> int:
  """The columns `pad_k` gives an operand of ``k`` columns."""
  return k if k % 64 == 0 or k % 8 else -(-k // 64) * 64


def pad_k(x: jax.Array) -> jax.Array:
  """``x [..., K]`` with zero columns up to a multiple of 64, for the Hopper
  kernel's 16-bit dtypes and K % 8 == 0 (16-byte rows).

  Why: Mosaic GPU tiles an operand in GMEM as it tiles shared memory, so the
  Hopper kernel's x needs K a multiple of its 64-deep steps; otherwise it
  falls back to 32-deep steps throughout, 20-25% slower on an H100. One
  padding copy of x (and
  none of w: TMA fills w's rows past K with zeros) buys full-depth steps
  for a K such as qwen2-72b's 29568 / 4 = 7392. Returns ``x`` itself when
  no padding applies (K a multiple of 64 or not of 8, or a dtype the Hopper
  kernel does not take).
  """
  k = x.shape[-1]
  if padded_k(k) == k or jnp.dtype(x.dtype) not in _MGPU_DTYPES:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded_k(k) - k)])


def _hopper_offset(row_offset) -> int | None:
  """Checks that the Hopper kernel can run here; the offset if static."""
  if jax.default_backend() != "gpu":
    raise ValueError(
        f"interpret=False needs a GPU backend (Hopper); the default backend is"
        f" {jax.default_backend()!r}. Use interpret=None or True.")
  return (int(row_offset) if isinstance(row_offset, (int, np.integer))
          else None)


def _resolve_interpret(interpret: bool | None) -> bool:
  if interpret is None:
    return jax.default_backend() == "cpu"
  return bool(interpret)


def chunk_matmul_into(
    out: jax.Array,
    x: jax.Array,
    w: jax.Array,
    row_offset: int | jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
) -> jax.Array:
  """Writes ``x @ w`` into rows ``[row_offset, row_offset + mc)`` of ``out``.

  Args:
    out: ``[M, n]`` output buffer, bf16/f16/f32. Aliased to the result: rows
      outside the chunk keep their values, and XLA needs no copy when ``out``
      has no other reader (otherwise it inserts one before the kernel).
    x: ``[mc, K]`` chunk of the left operand, bf16/f16/f32.
    w: ``[K, n]`` right operand, same dtype as ``x``.
    row_offset: first row of the chunk inside ``out``; a Python int (checked:
      ``0 <= row_offset <= M - mc``) or an int32 scalar that may be traced
      (e.g. from ``lax.axis_index``; not checked: an out-of-range traced
      offset gives unspecified results). The Hopper kernel needs it to be a
      multiple of 8: checked when static; a traced offset that is not left
      rows unwritten on an H200 (the kernel tells the compiler the offset is
      8-aligned). Chunk offsets ``c * mc`` with the kernel's ``mc`` (a
      multiple of 64) always are.
    num_sms: Hopper kernel only: the most CTAs (one per SM) the persistent
      kernel launches; each loops over output tiles. None: all SMs. Time
      goes in whole waves of ``ceil(tiles / num_sms)`` tiles, so a value just
      under the tile count can double the time (e.g. 128 tiles on 112 SMs).
    preferred_element_type: None or ``out.dtype`` (accumulation is always
      f32; the result is rounded to ``out.dtype``).
    interpret: True runs the portable kernel in interpret mode; False compiles
      the Hopper kernel; None: interpret on CPU, compile on GPU.
    config: Hopper tile config; None: ``default_config(mc, K, n, ...,
      num_sms=num_sms or all SMs)``.

  Returns:
    ``[M, n]`` array of ``out.dtype``: ``out`` with the chunk's rows replaced.
  """
  _check_args(out, x, w, row_offset, preferred_element_type)
  _check_num_sms(num_sms)
  off = _offset_operand(row_offset)
  if _resolve_interpret(interpret):
    return _portable_into(out, x, w, off, interpret=True)
  off_static = _hopper_offset(row_offset)
  return _mgpu_into(out, x, w, off, num_sms=num_sms, config=config,
                    off_static=off_static)


def chunk_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
) -> jax.Array:
  """``x [mc, K] @ w [K, n]`` → ``[mc, n]`` through the same kernels.

  The output dtype is ``preferred_element_type`` (default ``x.dtype``). See
  ``chunk_matmul_into`` for the other arguments.
  """
  for name, a in (("x", x), ("w", w)):
    if getattr(a, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(a, 'shape', None)}.")
  dtype = jnp.dtype(preferred_element_type or x.dtype)
  out = jnp.zeros((x.shape[0], w.shape[1]), dtype)
  return chunk_matmul_into(out, x, w, 0, num_sms=num_sms,
                           preferred_element_type=dtype, interpret=interpret,
                           config=config)


def chunk_matmul_rows(
    x: jax.Array,
    row_offset: int | jax.Array,
    rows: int,
    w: jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
) -> jax.Array:
  """``x[row_offset : row_offset + rows] @ w`` → ``[rows, n]``, reading the
  rows in place.

  The reduce-scatter's pieces are row blocks of its left operand at offsets
  that depend on the rank; the Hopper kernel TMA-loads them straight from
  ``x`` (no slice copy) into a fresh output (no zero fill).

  Args:
    x: ``[M, K]`` left operand, bf16/f16/f32.
    row_offset: first row read; a Python int (checked: ``0 <= row_offset <=
      M - rows``) or a traced int32 scalar, a multiple of 8 on the Hopper
      path. A traced offset is not checked: out of range, the Hopper kernel
      reads zeros past the end of ``x`` where interpret mode clamps it.
    rows: rows read (a multiple of the CTA tile's rows on the Hopper path).
    w: ``[K, n]``, same dtype as ``x``.
    num_sms, preferred_element_type, interpret, config: as for
      ``chunk_matmul_into``.

  Returns:
    ``[rows, n]`` array of ``preferred_element_type`` (default ``x.dtype``).
  """
  # One piece of chunk_matmul_pieces (same checks, same kernel).
  return chunk_matmul_pieces(x, [row_offset], rows, w, num_sms=num_sms,
                             preferred_element_type=preferred_element_type,
                             interpret=interpret, config=config)


def _static_rows(offsets) -> list:
  """The offsets to check: a `ByRank`'s every rank's, else the list."""
  if isinstance(offsets, ByRank):
    return [v for row in offsets.table for v in row]
  return list(offsets)


def _by_rank_offsets(dest_rows, x_rows) -> ByRank:
  """The kernel's ``2 * pieces`` offsets per rank, as a `ByRank`; a plain
  list (static ints) is the same for every rank."""
  # Both ByRank: they must hold the same rank (a traced value cannot be
  # compared here); the kernel reads the first one's.
  given = [o for o in (dest_rows, x_rows) if isinstance(o, ByRank)]
  ranks = {len(o.table) for o in given}
  if len(ranks) != 1:
    raise ValueError("out_rows and x_rows given as ByRank must have one row"
                     f" per rank each, got {sorted(ranks)} rows.")
  rows_of = lambda o, r: (o.table[r] if isinstance(o, ByRank)
                          else [int(v) for v in o])
  for o in (dest_rows, x_rows):
    if not isinstance(o, ByRank) and any(
        not isinstance(v, (int, np.integer)) for v in o):
      raise TypeError("With a ByRank offset list, the other list must hold"
                      " static ints (or be a ByRank too).")
  table = tuple(tuple(rows_of(dest_rows, r)) + tuple(rows_of(x_rows, r))
                for r in range(ranks.pop()))
  return ByRank(given[0].rank, table)


def _check_int_scalar(label, r) -> None:
  """``r`` is an int or an integer scalar array (traced or not)."""
  if isinstance(r, (int, np.integer)) and not isinstance(r, bool):
    return
  dt = getattr(r, "dtype", None)
  if (isinstance(r, bool) or dt is None or jnp.ndim(r) != 0
      or not jnp.issubdtype(dt, jnp.integer)):
    raise TypeError(
        f"{label} must be an int or an integer scalar array, got"
        f" {type(r).__name__} with dtype={dt},"
        f" shape={getattr(r, 'shape', None)}.")


def _static_int(name, v) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{name} must hold static ints, got {v!r}"
                    f" ({type(v).__name__}).")
  return int(v)


def _check_addends(addends, addend_rows, rows, n) -> None:
  """Each addend holds ``rows`` rows of ``n`` columns from its first row."""
  if len(addend_rows) != len(addends):
    raise ValueError(f"addend_rows has {len(addend_rows)} entries, addends"
                     f" {len(addends)}: one per addend.")
  for i, (a, a0) in enumerate(zip(addends, addend_rows)):
    shape = getattr(a, "shape", None)
    if getattr(a, "ndim", None) != 2 or shape[1] != n:
      raise ValueError(f"addends[{i}].shape={shape} must be 2-D with w's {n}"
                       " columns.")
    if jnp.dtype(a.dtype) not in _DTYPES:
      raise TypeError(f"addends[{i}].dtype={a.dtype} must be one of"
                      " bfloat16, float16, float32.")
    if not 0 <= a0 <= shape[0] - rows:
      raise ValueError(
          f"addend_rows[{i}]={a0} with the result's {rows} rows must lie in"
          f" [0, {shape[0] - rows}] (addends[{i}].shape={shape}).")


def _check_piece_rows(name, offsets, rows, shape):
  """Each static offset keeps its ``rows`` rows inside ``shape``; traced
  ones must be integer scalars (their range is not checked)."""
  if isinstance(offsets, ByRank):
    _check_int_scalar(f"{name}.rank", offsets.rank)
    offsets = _static_rows(offsets)
  for i, r in enumerate(offsets):
    if isinstance(r, (int, np.integer)) and not isinstance(r, bool):
      if not 0 <= r <= shape[0] - rows:
        raise ValueError(
            f"{name}[{i}]={r} with rows={rows} must lie in"
            f" [0, {shape[0] - rows}] so the piece fits in {shape[0]} rows"
            f" (shape {tuple(shape)}).")
      continue
    _check_int_scalar(f"{name}[{i}]", r)


def chunk_matmul_pieces(
    x: jax.Array,
    x_rows: Sequence[int | jax.Array] | ByRank,
    rows: int,
    w: jax.Array,
    *,
    out: jax.Array | None = None,
    out_rows: Sequence[int | jax.Array] | ByRank | None = None,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
    x_zero_padded_k: bool = False,
    addends: Sequence[jax.Array] = (),
    addend_rows: Sequence[int] | None = None,
    fresh_rows: int | None = None,
    _flags: jax.Array | None = None,
    _flag_variant: tuple[str, str] = ("piece", "piece_end"),
) -> jax.Array:
  """Several row pieces of ``x``, each times ``w``, in one kernel launch.

  Piece ``i`` is ``x[x_rows[i] : x_rows[i] + rows] @ w``, read in place.
  Without ``out`` the pieces are stacked in order into a fresh array: the
  reduce-scatter's step granularity (the partials of every peer, whose rows
  are not contiguous in ``x``, as one dot with no gathering copy). With
  ``out``, piece ``i`` is written into rows ``[out_rows[i], out_rows[i] +
  rows)`` of ``out`` (aliased, as `chunk_matmul_into`): the all-gather's
  step granularity (landed pieces written at their owners' rows).

  Args:
    x: ``[M, K]`` left operand, bf16/f16/f32.
    x_rows: first row of each piece in ``x``: Python ints (checked: ``0 <=
      r <= M - rows``) or traced int32 scalars (not checked), multiples of 8
      on the Hopper path; or a `ByRank` (each rank's static rows, checked),
      which the Hopper kernel compiles in so that it reads only the rank.
    rows: rows per piece (a multiple of the CTA tile's rows on the Hopper
      path, so no tile straddles two pieces).
    w: ``[K, n]``, same dtype as ``x``.
    out: None, or the ``[M_out, n]`` array the pieces are written into.
    out_rows: with ``out`` or ``fresh_rows``, the first row of each piece
      in the result (same rules as ``x_rows``; with a `ByRank` on either
      side the other holds static ints or a `ByRank` of the same rank);
      None otherwise (pieces stacked from row 0).
    num_sms, preferred_element_type, interpret, config: as for
      ``chunk_matmul_into`` (with ``out``, ``preferred_element_type`` must be
      None or ``out.dtype``).
    x_zero_padded_k: ``x`` is `pad_k`'s output for a ``w`` of ``K`` rows:
      its columns past ``K`` are zeros (not checked), up to a multiple of 64.
    addends: arrays of ``n`` columns added to the product, in f32, before
      it is rounded: row ``t`` of the product (its pieces stacked, before
      they are placed) gets ``a[a0 + t]`` of each addend ``a``. The
      reduce-scatter adds the partials pulled from its peers this way, in
      the kernel's epilogue, instead of in a separate pass.
    addend_rows: the static first row ``a0`` read from each addend (None:
      0 for every addend), a multiple of 8 on the Hopper path; so one
      buffer holding several partials is given once per partial, unsliced.
    fresh_rows: without ``out``: the rows of the fresh result, the pieces
      placed at ``out_rows``; rows no piece covers are left **unwritten**
      (the caller fills them, e.g. with later calls that pass this result
      as ``out``). None: the pieces stacked, ``len(x_rows) * rows`` rows.
      On the Hopper path the result is typed invariant over shard_map's
      axes, as every result written in place is (jax >= 0.11 takes no
      varying Ref): restore its type with `vma.vary_like` when done.

  Returns:
    ``[len(x_rows) * rows, n]`` (or ``[fresh_rows, n]``) of
    ``preferred_element_type`` (default ``x.dtype``), or ``out`` with the
    pieces' rows replaced.
  """
  if getattr(x, "ndim", None) != 2 or getattr(w, "ndim", None) != 2:
    raise ValueError(
        f"x and w must be 2-D, got x.shape={getattr(x, 'shape', None)},"
        f" w.shape={getattr(w, 'shape', None)}.")
  if not isinstance(x_rows, ByRank):
    x_rows = list(x_rows)
  if not len(x_rows):  # pylint: disable=g-explicit-length-test
    raise ValueError("x_rows must name at least one piece, got [].")
  if (isinstance(rows, bool) or not isinstance(rows, int)
      or not 0 < rows <= x.shape[0]):
    raise ValueError(f"rows={rows!r} must be an int in [1, {x.shape[0]}]"
                     f" (x.shape={x.shape}).")
  if fresh_rows is not None:
    if out is not None or out_rows is None:
      raise ValueError("fresh_rows needs out=None and out_rows (where the"
                       " pieces go in the fresh result).")
    if (isinstance(fresh_rows, bool) or not isinstance(fresh_rows, int)
        or fresh_rows < rows):
      raise ValueError(f"fresh_rows={fresh_rows!r} must be an int of at"
                       f" least rows={rows}.")
  elif (out is None) != (out_rows is None):
    raise ValueError("out and out_rows go together: pass both or neither"
                     f" (out is {'None' if out is None else 'given'}).")
  if out_rows is not None:
    if not isinstance(out_rows, ByRank):
      out_rows = list(out_rows)
    if len(out_rows) != len(x_rows):
      raise ValueError(f"out_rows has {len(out_rows)} entries, x_rows"
                       f" {len(x_rows)}: one per piece.")
  if out is not None:
    dtype = jnp.dtype(out.dtype)
  else:
    dtype = jnp.dtype(preferred_element_type or x.dtype)
  _check_num_sms(num_sms)
  addends = list(addends)
  addend_rows = ([0] * len(addends) if addend_rows is None
                 else [_static_int("addend_rows", a) for a in addend_rows])
  _check_addends(addends, addend_rows, len(x_rows) * rows, w.shape[1])
  if x_zero_padded_k:
    k = w.shape[0]
    if x.shape[1] != padded_k(k):
      raise ValueError(
          f"x_zero_padded_k: x.shape={x.shape} must have padded_k(K) ="
          f" {padded_k(k)} columns for w.shape={w.shape} (use pad_k).")
  n_pieces = len(x_rows)
  piece_type = jax.ShapeDtypeStruct(
      (rows, w.shape[0] if x_zero_padded_k else x.shape[1]), x.dtype)
  target = (out if out is not None else jax.ShapeDtypeStruct(
      (fresh_rows or n_pieces * rows, w.shape[1]), dtype))
  # Shapes and dtypes, as for one piece written at row 0 of the target.
  _check_args(target, piece_type, w, 0, preferred_element_type)
  _check_piece_rows("x_rows", x_rows, rows, x.shape)
  if out_rows is not None:
    _check_piece_rows("out_rows", out_rows, rows, target.shape)
  if _resolve_interpret(interpret):
    if x_zero_padded_k:
      x = x[:, :w.shape[0]]
    x_rows = x_rows.traced() if isinstance(x_rows, ByRank) else x_rows
    if isinstance(out_rows, ByRank):
      out_rows = out_rows.traced()
    pieces = [lax.dynamic_slice_in_dim(x, r, rows, axis=0) for r in x_rows]
    if fresh_rows is not None:
      out = jnp.zeros((fresh_rows, w.shape[1]), dtype)
    if addends:
      # As the kernel: the f32 product plus the addends, rounded once.
      total = chunk_matmul(jnp.concatenate(pieces, 0), w,
                           preferred_element_type=jnp.float32,
                           interpret=True)
      for a, a0 in zip(addends, addend_rows):
        total = total + a[a0:a0 + total.shape[0]].astype(jnp.float32)
      total = total.astype(dtype)
      if out is None:
        return total
      for i, r in enumerate(out_rows):
        out = lax.dynamic_update_slice_in_dim(
            out, total[i * rows:(i + 1) * rows], r, axis=0)
      return out
    if out is None:
      return chunk_matmul(jnp.concatenate(pieces, 0), w,
                          preferred_element_type=dtype, interpret=True)
    for piece, r in zip(pieces, out_rows):
      out = chunk_matmul_into(out, piece, w, r, interpret=True)
    return out
  for r in (*_static_rows(x_rows), *_static_rows(out_rows or ()),
            *addend_rows):
    if isinstance(r, (int, np.integer)) and r % 8:
      raise ValueError(
          f"row offset {r} must be a multiple of 8 on the Hopper path (TMA"
          " transfers of 8-row tiled shared memory).")
  _hopper_offset(0)
  dest_rows = (out_rows if out_rows is not None
               else [i * rows for i in range(n_pieces)])
  if isinstance(x_rows, ByRank) or isinstance(dest_rows, ByRank):
    off = _by_rank_offsets(dest_rows, x_rows)
  else:
    off = _offsets(dest_rows, x_rows)
  return _mgpu_into(out, x, w, off,
                    num_sms=num_sms, config=config, rows=n_pieces * rows,
                    out_dtype=dtype, addends=addends, addend_rows=addend_rows,
                    fresh_rows=fresh_rows, flags=_flags,
                    flag_variant=_flag_variant)


def chunk_matmul_flagged(
    x: jax.Array,
    x_rows: ByRank,
    rows: int,
    w: jax.Array,
    flags: jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
    x_zero_padded_k: bool = False,
) -> tuple[jax.Array, jax.Array, int]:
  """`chunk_matmul_pieces` (stacked, fresh result) that signals each piece.

  One launch multiplies every piece, in order, and bumps ``flags[i]``
  once per compute warpgroup of each CTA, after that CTA's last tile of
  piece ``i`` is stored: the reduce-scatter's flagged granularity,
  whose copy engines start on a piece as soon as its flag reaches the
  target, with one kernel and one start per op instead of one of each per
  piece.

  Args:
    x, x_rows, rows, w, num_sms, preferred_element_type, interpret, config,
      x_zero_padded_k: as for `chunk_matmul_pieces`.
    flags: ``int32[len(pieces)]`` of zeros (`peer_copy.arm`'s), typed
      invariant over shard_map's axes (the kernel writes it in place).

  Returns:
    (the stacked pieces, the flags as written, the target a flag reaches
    once its piece is complete). Interpret mode computes everything before
    it returns, so there every flag is 1 and the target 1.
  """
  n_pieces = len(x_rows)
  if (getattr(flags, "shape", None) != (n_pieces,)
      or getattr(flags, "dtype", None) != jnp.int32):
    raise ValueError(
        f"flags must be int32[{n_pieces}] (one per piece), got"
        f" {getattr(flags, 'dtype', None)}{list(getattr(flags, 'shape', []))}.")
  interpret = _resolve_interpret(interpret)
  out = chunk_matmul_pieces(x, x_rows, rows, w, num_sms=num_sms,
                            preferred_element_type=preferred_element_type,
                            interpret=interpret, config=config,
                            x_zero_padded_k=x_zero_padded_k,
                            _flags=None if interpret else flags)
  # The Hopper path returns (pieces, flags, target) itself.
  return (out, flags + 1, 1) if interpret else out
