"""Grouped matmul for the MoE ops: ``x [M, K]`` rows in groups, group g
times ``w[g] [K, N]``; the experts' compute of ``compute="pallas"``.

Why not ``lax.ragged_dot``: XLA:GPU multiplies every row by every group's
matrix and masks (measured on H200: a grouped matmul of E_l groups costs
about E_l times its flops), so the MoE layer's experts dominate the step.
A grouped kernel multiplies each row once.

Three kernels, one contract (rows past ``sum(group_sizes)`` are 0):

* GPUs: ficco's warp-specialized Hopper kernel (`grouped_hopper`, one TMA
  warpgroup and two wgmma warpgroups per CTA, tiles read from `tile_table`)
  with a `ChunkMatmulConfig`, the default where it fits; or jax's Mosaic
  GPU grouped matmul (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``,
  one warpgroup per CTA), called as shipped with jax, with a `Block`.
  Both take bf16/f16 operands, K and N multiples of their tiles, rows
  padded here to a multiple of 8 (their TMA tiling). Ficco's kernel
  stores the zeros past the groups itself; jax's leaves those rows
  unwritten, so they are masked here.
* Off GPUs: the portable kernel below, a ``pl.pallas_call`` under
  ``interpret=True``: one program per (row tile, column block) of the
  groups' tiles, read from a tile table computed in XLA
  (`tile_table`), so the grouping logic is tested on CPU.

The gradient: ``dx`` is the same kernel reading each ``w[g]`` transposed
where it lies (``transpose_w``; ``transpose_rhs`` for jax's); ``dw`` on GPUs
is jax's transposed grouped matmul (``transposed_ragged_dot_mgpu``: per
group, its rows of x transposed times its rows of the cotangent) where it
fits (`dw_unfit`), else XLA's transpose of ``ragged_dot``, which, like
``ragged_dot`` itself, costs about as many times the flops as there are
groups on XLA:GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ficco_jax._src import devices
from ficco_jax._src import vma
from ficco_jax._src.pallas import grouped_hopper
from ficco_jax._src.pallas import out_types
from ficco_jax._src.pallas import portable
from ficco_jax._src.pallas.config import ChunkMatmulConfig
from ficco_jax._src.pallas.config import grouped_operands_unfit
from ficco_jax._src.pallas.config import MGPU_DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
  """Tiles of the Mosaic GPU kernel (``ragged_dot_mgpu.ragged_dot``'s
  arguments): 128x128 output tiles, 64-deep steps, four in flight."""

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Block.{f.name}={v!r} must be a positive int.")
    for name in ("block_m", "block_n", "block_k"):
      if getattr(self, name) % 64:  # wgmma tiles: one warpgroup, 64 rows.
        raise ValueError(f"Block.{name}={getattr(self, name)} must be a"
                         " multiple of 64.")


BLOCK = Block()
# ficco's kernel's tiles, the ones `choose_block` tries (first fitting
# wins): its default 128x256 CTA tile, then 128x128 for widths that are not
# a multiple of 256 (deepseek-v2-lite's 1408). Together they take every
# shape jax's kernel takes (K a multiple of 64, N of 128), and on an H200
# they ran 1.07-1.47x as fast as jax's best tiles on the balanced benchmark
# shapes (``--suite=kernel --kernel_mode=grouped``, benchmarks/results/
# nvidia_h200_w1/kernel_grouped.json), so jax's kernel runs only when a
# `Block` is asked for.
HOPPER_CONFIGS = (
    grouped_hopper.DEFAULT_CONFIG,
    dataclasses.replace(grouped_hopper.DEFAULT_CONFIG, tile_n=128),
)
# The weight gradient's kernel's tiles (jax's transposed_ragged_dot_mgpu),
# first fitting wins: 128x128 tiles of dw[g], 64 rows of the group per
# step, two column blocks per grid step where N allows (on an H200 as fast
# or up to 25% faster than one on the MoE benchmark shapes, ``--suite=kernel
# --kernel_mode=grouped_dw``), else one.
DW_BLOCKS = (Block(block_m=128, block_n=128, block_k=64,
                   max_concurrent_steps=4, grid_block_n=2),
             Block(block_m=128, block_n=128, block_k=64,
                   max_concurrent_steps=4, grid_block_n=1))
# The portable kernel's row tile: small, so the tests' few rows still span
# several tiles and group boundaries inside them.
PORTABLE_BLOCK_M = 8


def mosaic_unfit(k: int, n: int, dtype,
                 block: Block | ChunkMatmulConfig = HOPPER_CONFIGS[-1]
                 ) -> str | None:
  """Why ``[., k] @ [k, n]`` in ``dtype`` does not suit the GPU kernel with
  ``block``'s tiles (a `ChunkMatmulConfig`: ficco's kernel; a `Block`:
  jax's), or None (the forward pass needs it for (K, N), the gradient for
  (N, K))."""
  if isinstance(block, ChunkMatmulConfig):
    return grouped_hopper.unfit(k, n, dtype, block)
  return grouped_operands_unfit(
      dtype, ("K", k, block.block_k),
      ("N", n, block.block_n * block.grid_block_n))


def _first_fitting(candidates, unfit):
  """The first candidate ``unfit`` passes (None), else the last."""
  return next((b for b in candidates if unfit(b) is None), candidates[-1])


def choose_block(k: int, n: int, dtype) -> ChunkMatmulConfig:
  """The first of `HOPPER_CONFIGS` that suits ``[., k] @ [k, n]``
  (`mosaic_unfit`), else the last (whose error then names the misfit)."""
  return _first_fitting(HOPPER_CONFIGS,
                        lambda b: mosaic_unfit(k, n, dtype, b))


def dw_unfit(k: int, n: int, dtype, w_dtype,
             block: Block = DW_BLOCKS[-1]) -> str | None:
  """Why the weight gradient ``dw [G, k, n]`` of bf16/f16 rows cannot run
  on the GPU kernel with ``block``, or None."""
  if (jnp.dtype(dtype) in MGPU_DTYPES
      and jnp.dtype(w_dtype) != jnp.dtype(dtype)):
    # The kernel's dw is in the operands' dtype.
    return f"w is {jnp.dtype(w_dtype)}, the rows {jnp.dtype(dtype)}"
  return grouped_operands_unfit(
      dtype, ("K", k, block.block_m),
      ("N", n, block.block_n * block.grid_block_n))


def choose_dw_block(k: int, n: int, dtype) -> Block:
  """The first of `DW_BLOCKS` that suits ``dw [., k, n]`` (`dw_unfit`), else
  the last (whose error then names the misfit)."""
  return _first_fitting(DW_BLOCKS, lambda b: dw_unfit(k, n, dtype, dtype, b))


def mosaic_dw(x: jax.Array, ct: jax.Array, group_sizes: jax.Array,
              block: Block | None = None) -> jax.Array:
  """``[G, K, N]``: per group g, ``x[rows of g].T @ ct[rows of g]`` on jax's
  transposed grouped matmul (GPU; `dw_unfit` must be None; ``block`` None:
  `choose_dw_block`). ``ct``'s rows past the groups must be zeros."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  block = block or choose_dw_block(x.shape[1], ct.shape[1], x.dtype)
  # The kernel drops the rows of a neighbouring group in a group's first and
  # last step by multiplying them by 0, and 0 * NaN is NaN: rows past the
  # groups, which the contract ignores, must be zeros here (the cotangent's
  # are, `zero_past_groups`). Its TMA tiles the rows it steps over: pad
  # them to a whole number of steps (past every group too).
  x = zero_past_groups(x, group_sizes)
  pad = ((0, -x.shape[0] % block.block_k), (0, 0))
  dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
      jnp.pad(x, pad), jnp.pad(ct.astype(x.dtype), pad),
      group_sizes=group_sizes.astype(jnp.int32), **dataclasses.asdict(block))
  # An empty group's tiles are stored too, from an accumulator that starts
  # at zero (the GPU test checks they read 0). Its result is typed
  # invariant; under shard_map its rows are the operands' (vma).
  return vma.vary_like(dw, x, ct, group_sizes)


def tile_table(group_sizes: jax.Array, rows: int, block_m: int) -> jax.Array:
  """``[4, tiles]`` int32: per row tile of the groups, its group, first row
  (a multiple of ``block_m``), and the span ``[lo, hi)`` of its rows that
  are the group's. A tile that a group boundary cuts appears once per
  group; tiles past the last group have ``lo == hi``.

  ``tiles = ceil(rows / block_m) + G - 1`` bounds the count: each boundary
  adds at most one tile.
  """
  return _table_and_counts(group_sizes, rows, block_m)[0]


def _table_and_counts(group_sizes: jax.Array, rows: int, block_m: int):
  """`tile_table`, the count of its live tiles (a prefix) and the groups'
  rows, as ``(table, live, total)``.

  The routing is known only at run time, so this runs on the device before
  the kernel, every call, as a few small XLA kernels whose launches cost
  more than their work: the running sums are masked sums over a
  ``[G, G]`` triangle and the tile-to-group search one fused compare,
  reductions that XLA fuses with their neighbours, where ``jnp.cumsum``
  and a binary search would each be kernels of their own (or a loop of
  them); the counts come from the same sums, not from reductions over the
  table.
  """
  g = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  # Inclusive running sums: row i of the triangle holds groups 0..i.
  tri = (lax.broadcasted_iota(jnp.int32, (g, g), 0)
         >= lax.broadcasted_iota(jnp.int32, (g, g), 1))
  running = lambda v: jnp.sum(jnp.where(tri, v[None, :], 0), axis=1)
  ends = running(sizes)
  starts = ends - sizes
  first = starts // block_m
  last = (ends - 1) // block_m
  count = jnp.where(sizes > 0, last - first + 1, 0)
  cum_count = running(count)  # Tiles up to and including each group.
  before = cum_count - count  # Tiles of earlier groups.
  tiles = -(-rows // block_m) + g - 1
  t = jnp.arange(tiles, dtype=jnp.int32)
  # The group of tile t: how many groups end at or before it (a search by
  # one fused compare of tiles x groups).
  grp = jnp.clip(jnp.sum((cum_count[None, :] <= t[:, None]).astype(jnp.int32),
                         axis=1), 0, g - 1)
  live_tiles = cum_count[g - 1]
  live = t < live_tiles
  block = first[grp] + (t - before[grp])
  row = block * block_m
  lo = jnp.clip(starts[grp] - row, 0, block_m)
  hi = jnp.clip(ends[grp] - row, 0, block_m)
  lo, hi = jnp.where(live, lo, 0), jnp.where(live, hi, 0)
  table = jnp.stack([grp, jnp.where(live, row, 0), lo, hi]).astype(jnp.int32)
  return table, live_tiles, ends[g - 1]


def _portable_kernel(table_ref, x_ref, w_ref, out_in_ref, out_ref, *,
                     block_m, block_n):
  # table_ref: [4, tiles] int32, whole (tile_table). x_ref: [M_pad, K] and
  # w_ref: [G, K, N], whole. out_ref: [M_pad, N], aliased to out_in_ref
  # (zeros): each program writes only its group's rows of its tile, so two
  # programs sharing a cut tile keep each other's rows.
  del out_in_ref
  t, j = pl.program_id(0), pl.program_id(1)
  grp, row = table_ref[0, t], table_ref[1, t]
  lo, hi = table_ref[2, t], table_ref[3, t]

  @pl.when(hi > lo)
  def _():
    rows = pl.ds(row, block_m)
    cols = pl.ds(j * block_n, block_n)
    # f32 accumulation, or f64 where an operand or the result is f64.
    acc_dtype = functools.reduce(jnp.promote_types, (
        x_ref.dtype, w_ref.dtype, out_ref.dtype), jnp.dtype(jnp.float32))
    acc = jnp.dot(x_ref[rows, :], w_ref[grp, :, cols],
                  preferred_element_type=acc_dtype)
    i = lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    mine = (i >= lo) & (i < hi)
    out_ref[rows, cols] = jnp.where(mine, acc.astype(out_ref.dtype),
                                    out_ref[rows, cols])


def _portable(x, w, group_sizes, out_dtype, block):
  del block  # The interpreter's tiles are its own (PORTABLE_BLOCK_M).
  m, k = x.shape
  g, _, n = w.shape
  bm = PORTABLE_BLOCK_M
  bn = portable.largest_divisor_at_most(n, 128)
  if bn < 8:  # A prime-ish N: one column block (the interpreter's grid is
    bn = n    # a Python loop; any block width works).
  m_pad = -(-m // bm) * bm
  if any(vma.varying_axes(a) for a in (x, w, group_sizes)):
    # As for the chunk kernel's interpreter (portable.py): its grid indices
    # are typed invariant, which shard_map's check_vma rejects.
    raise ValueError(
        "compute='pallas' off GPUs runs Pallas's interpreter, which does not"
        " take shard_map's varying-axes checks: call jax.shard_map(...,"
        " check_vma=False) around it, or use Schedule(compute='xla').")
  table = tile_table(group_sizes, m, bm)
  out = jnp.zeros((m_pad, n), out_dtype)
  out = pl.pallas_call(
      functools.partial(_portable_kernel, block_m=bm, block_n=bn),
      out_shape=out_types.out_type(out.shape, out_dtype, like=(out,)),
      grid=(table.shape[1], n // bn),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 4,
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      input_output_aliases={3: 0},
      name="ficco_grouped_matmul",
      interpret=True,
  )(table, jnp.pad(x, ((0, m_pad - m), (0, 0))), w, out)
  return out[:m]


def _mosaic(x, w, group_sizes, out_dtype, block, transpose_w=False):
  n = w.shape[1 if transpose_w else 2]
  block = block or choose_block(x.shape[1], n, x.dtype)
  why = mosaic_unfit(x.shape[1], n, x.dtype, block)
  if why is None and jnp.dtype(out_dtype) != jnp.dtype(x.dtype):
    why = f"the result dtype {jnp.dtype(out_dtype)} is not the operands'"
  if why is not None:
    w_shape = w.shape if not transpose_w else (w.shape[0], w.shape[2],
                                               w.shape[1])
    raise ValueError(f"compute='pallas': the grouped matmul's GPU kernel"
                     f" cannot run x {tuple(x.shape)} @ w {tuple(w_shape)}:"
                     f" {why}. Use Schedule(compute='xla').")
  # Their TMA transfers tile the rows by 8: pad them to a multiple (the pad
  # rows are past every group, so nothing multiplies them).
  m = x.shape[0]
  x = jnp.pad(x, ((0, -m % 8), (0, 0)))
  if isinstance(block, ChunkMatmulConfig):
    # The kernel stores zeros past the groups itself.
    table, live, total = _table_and_counts(group_sizes, x.shape[0],
                                           block.cta_tile_m)
    return grouped_hopper.grouped_into(x, w, table, config=block,
                                       transpose_w=transpose_w,
                                       counts=(live, total))[:m]
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  return zero_past_groups(ragged_dot_mgpu.ragged_dot(
      x, w.astype(x.dtype), group_sizes=group_sizes.astype(jnp.int32),
      transpose_rhs=transpose_w, **dataclasses.asdict(block))[:m],
                          group_sizes)


def zero_past_groups(a: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """``a [M, .]`` with its rows past ``sum(group_sizes)`` set to 0."""
  valid = lax.broadcasted_iota(jnp.int32, (a.shape[0], 1), 0) < jnp.sum(
      group_sizes.astype(jnp.int32))
  return jnp.where(valid, a, jnp.zeros((), a.dtype))


def _impl(x, w, group_sizes, out_dtype, on_gpu, block, transpose_w=False):
  """x times each group's w (``w[g].T`` as stored, ``transpose_w``). All
  paths give zeros past the groups: the portable kernel's result starts as
  zeros, ficco's Hopper kernel stores them, jax's is followed by a pass."""
  if on_gpu:
    return _mosaic(x, w, group_sizes, out_dtype, block, transpose_w)
  if transpose_w:  # The interpreter: a copy costs nothing that matters.
    w = jnp.swapaxes(w, 1, 2)
  return _portable(x, w, group_sizes, out_dtype, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, out_dtype, on_gpu, block):
  return _impl(x, w, group_sizes, out_dtype, on_gpu, block)


def _grouped_fwd(x, w, group_sizes, out_dtype, on_gpu, block):
  return (_impl(x, w, group_sizes, out_dtype, on_gpu, block),
          (x, w, group_sizes))


def _grouped_bwd(out_dtype, on_gpu, block, res, ct):
  del out_dtype
  x, w, group_sizes = res
  # The forward pass zeroes rows past the groups, so their cotangent is 0:
  # said here rather than left to ragged_dot's transpose, which promises
  # nothing about those rows.
  ct = zero_past_groups(ct, group_sizes)
  # dx on the kernel (its operands in x's dtype), reading each w[g]
  # transposed where it lies rather than from a transposed copy of w.
  dx = _impl(ct.astype(x.dtype), w.astype(x.dtype), group_sizes, x.dtype,
             on_gpu, block, transpose_w=True)
  if on_gpu and dw_unfit(x.shape[1], w.shape[2], x.dtype, w.dtype) is None:
    # Fits the smallest of DW_BLOCKS (mosaic_dw takes a wider one where it
    # fits). On the GPU path the result, and so ct, is in the operands'
    # dtype: the kernel rounds nothing the XLA path below would keep.
    return dx, mosaic_dw(x, ct, group_sizes).astype(w.dtype), None
  # dw from the unrounded cotangent, in f32 (or f64, where an operand or
  # the cotangent is f64).
  acc = functools.reduce(jnp.promote_types, (x.dtype, w.dtype, ct.dtype),
                         jnp.dtype(jnp.float32))
  _, vjp_w = jax.vjp(
      lambda w: lax.ragged_dot(x, w, group_sizes,
                               preferred_element_type=acc), w)
  (dw,) = vjp_w(ct.astype(acc))
  return dx, dw.astype(w.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   out_dtype=None, on_gpu: bool | None = None,
                   block: Block | ChunkMatmulConfig | None = None) -> jax.Array:
  """``x [M, K]`` in groups (``group_sizes [G]`` consecutive rows each) times
  ``w [G, K, N]``; rows past ``sum(group_sizes)`` are 0. Differentiable in
  ``x`` and ``w``.

  Args:
    x: the rows, grouped in order.
    w: one ``[K, N]`` matrix per group.
    group_sizes: ``[G]`` int rows per group (their sum at most M).
    out_dtype: the result's dtype (default ``x``'s).
    on_gpu: the Mosaic GPU kernel (True) or the portable one under the
      interpreter (False); None: by the traced devices' platform.
    block: the GPU kernel and its tiles: a `ChunkMatmulConfig` runs
      ficco's kernel, a `Block` jax's (None: `choose_block` per matmul, the
      gradient's included; the ``kernel`` suite's ``--kernel_mode=grouped``
      times others).

  Returns:
    ``[M, N]``.
  """
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"grouped_matmul: x must be [M, K], got shape"
                     f" {tuple(getattr(x, 'shape', ()))}.")
  if getattr(w, "ndim", None) != 3 or w.shape[1] != x.shape[1]:
    raise ValueError(f"grouped_matmul: w must be [G, K, N] with K ="
                     f" x.shape[1] = {x.shape[1]}, got shape"
                     f" {tuple(getattr(w, 'shape', ()))}.")
  if (getattr(group_sizes, "shape", None) != (w.shape[0],)
      or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
    raise ValueError(f"grouped_matmul: group_sizes must be [G] = "
                     f"[{w.shape[0]}] integers (one per matrix of w), got"
                     f" {getattr(group_sizes, 'dtype', type(group_sizes))}"
                     f"{tuple(getattr(group_sizes, 'shape', ()))}.")
  if on_gpu is None:
    on_gpu = devices.platform() == "gpu"
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if block is not None and not isinstance(block, (Block, ChunkMatmulConfig)):
    raise TypeError(f"block must be a grouped_matmul.Block or a"
                    f" ChunkMatmulConfig, got {block!r}.")
  return _grouped(x, w, group_sizes, out_dtype, bool(on_gpu), block)
