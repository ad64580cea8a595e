"""The warp-specialized Hopper grouped matmul (Mosaic GPU: wgmma + TMA).

``x [M, K]`` rows in consecutive groups, group g times ``w[g] [K, N]``: the
experts' compute of the MoE ops on Hopper GPUs.

Why a kernel of our own beside jax's ``ragged_dot_mgpu``: that kernel runs
one warpgroup per CTA that both issues the TMA loads and waits on each
``wgmma``, so the tensor cores idle between steps. On an H200 with group
boundaries off the tiles it runs at 0.78-0.88x the speed of cuBLAS's dense
batched matmul on mixtral-8x7b and 0.45-0.57x on qwen3-30b-a3b, this
kernel at 0.98-0.99x and 0.65-0.73x (the ``kernel`` suite,
``--kernel_mode=grouped --grouped_jitter=37``). This
kernel has `hopper.py`'s structure -- one memory warpgroup issuing TMA
loads, two compute warpgroups each owning a ``tile_m x tile_n``
accumulator, a persistent loop over the output tiles -- with the tiles
read from a table:

* The row tiles come from `grouped_matmul.tile_table` (computed in XLA):
  per tile its group, first row (a multiple of the CTA tile's rows) and the
  span ``[lo, hi)`` of its rows that are the group's. A tile that a group
  boundary cuts is computed once per group; tiles past the last group are
  skipped, so dead rows cost nothing.
* The epilogue stores only the group's rows of a tile. TMA stores need a
  static row count, so the rows go out as a ladder of power-of-two TMA
  stores (the trick jax's ``ragged_dot_mgpu`` uses) from an unswizzled
  shared-memory tile: one store per epilogue column block of a whole tile,
  at most ``log2(tile_m) + 1`` for a cut one. Rows of ``out`` past the
  groups get zeros by the same ladder, after the live tiles, so no XLA pass
  over the result zeroes them.

Mosaic GPU is imported inside the functions, so this module imports on a
jaxlib without it; the tests run the kernel on CPU under jax's Mosaic GPU
interpreter (``interpret_params``).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ficco_jax._src import devices
from ficco_jax._src.pallas import hopper
from ficco_jax._src.pallas import out_types
from ficco_jax._src.pallas.config import ChunkMatmulConfig
from ficco_jax._src.pallas.config import grouped_operands_unfit
from ficco_jax._src.pallas.config import SMEM_BUDGET

# The tiles used when the caller names none: `hopper.py`'s best chunk tile
# (a 128x256 CTA tile, two 64x256 warpgroup tiles), four pipeline stages
# beside a 64x128 unswizzled epilogue tile per warpgroup (224 KiB in all),
# and a snake over bands of 8 row tiles so that the CTAs in flight share a
# few row tiles of x and a few column blocks of w[g]. On an H200 (the
# ``kernel`` suite, ``--kernel_mode=grouped``) it was the fastest of the
# tiles swept on the mixtral widths and within 4% of the fastest on the
# others, ahead of three stages with a whole 64x256 epilogue tile by 1-9%
# (that sweep is in the git history of benchmarks/results/nvidia_h200_w1/
# kernel_grouped.json; the file now holds it against the 128x128 tile).
DEFAULT_CONFIG = ChunkMatmulConfig(
    tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=4, epi_tile_m=64,
    epi_tile_n=128, wg_dimension="m", grid_minor_dim="m", grid_tile_width=8)


def smem_bytes(config: ChunkMatmulConfig, in_dtype, out_dtype) -> int:
  """Shared memory one CTA of this kernel allocates: the pipeline's stages
  and each compute warpgroup's unswizzled ``tile_m x epi_tile_n`` tile."""
  isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
  stage = (config.cta_tile_m + config.cta_tile_n) * config.tile_k * isz
  return (config.max_concurrent_steps * stage
          + 2 * config.tile_m * config.epi_tile_n * osz)


def unfit(k: int, n: int, dtype, config: ChunkMatmulConfig = DEFAULT_CONFIG,
          out_dtype=None) -> str | None:
  """Why ``[., k] @ [k, n]`` in ``dtype`` does not suit this kernel with
  ``config``, or None."""
  why = grouped_operands_unfit(dtype, ("K", k, config.tile_k),
                              ("N", n, config.cta_tile_n))
  if why is not None:
    return why
  if config.tile_n % config.epi_tile_n:
    return (f"epi_tile_n={config.epi_tile_n} does not divide"
            f" tile_n={config.tile_n}")
  row_bytes = config.epi_tile_n * jnp.dtype(out_dtype or dtype).itemsize
  if row_bytes % 128:
    # The ladder's TMA stores start at any row of the unswizzled epilogue
    # tile: each row must start 128-byte aligned (64 bytes faulted with a
    # misaligned address on an H200).
    return (f"epi_tile_n={config.epi_tile_n} makes {row_bytes}-byte rows of"
            " the epilogue tile; they must be a multiple of 128 bytes")
  used = smem_bytes(config, dtype, out_dtype or dtype)
  if used > SMEM_BUDGET:
    return (f"its tiles take {used} bytes of shared memory, more than"
            f" {SMEM_BUDGET}")
  return None


def _transposed(ref):
  """``ref`` read transposed by ``wgmma``. jax 0.11 deprecates
  ``plgpu.transpose_ref`` for ``ref.transpose``; jax 0.10 keeps the former,
  since the GPU image (jax 0.11 only) has never run 0.10 with the latter."""
  if jax.__version_info__ >= (0, 11):
    return ref.transpose((1, 0))
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.
  return plgpu.transpose_ref(ref, (1, 0))


def _kernel(table_gmem, x_gmem, w_gmem, out_gmem, *, config, k_iters,
            tiles, transpose_w):
  # table_gmem: (4 * tiles + 2,) int32 GMEM, tile_table flattened (group,
  #             first row, lo, hi of each row tile; the live tiles are a
  #             prefix), then the live tiles' count and the groups' rows.
  # x_gmem:     (M, K) GMEM; a tile's rows past M read as zeros (TMA).
  # w_gmem:     (G, K, N) GMEM; (G, N, K) with transpose_w.
  # out_gmem:   (M, N) GMEM, fresh: every row is written, the groups' rows
  #             with their product, the rest with zeros.
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.

  c = config
  dtype, out_dtype = x_gmem.dtype, out_gmem.dtype
  tile_m, tile_n = c.tile_m, c.tile_n
  cta_tile_m, cta_tile_n = c.cta_tile_m, c.cta_tile_n
  epi_n = c.epi_tile_n
  n_iters = w_gmem.shape[1 if transpose_w else 2] // cta_tile_n
  m_out = out_gmem.shape[0]

  minor = 0 if c.grid_minor_dim == "m" else 1
  get_pipeline = hopper.operand_pipeline(c, k_iters, dtype, transpose_w)

  ignore = lambda *_, **__: None  # The bodies don't change the allocations.

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
          x_gmem, w_gmem.at[0]),
      # Unswizzled: the ladder's stores start at any row of the tile.
      out_smem=plgpu.SMEM((2, tile_m, epi_n), out_dtype),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg_idx = lax.axis_index("wg")
    # The walk: the live tiles (the snake), then the row blocks from the
    # one holding the groups' last row on, whose rows past the groups are
    # stored as zeros (no XLA pass over the result to zero them).
    live = table_gmem[4 * tiles]
    total = table_gmem[4 * tiles + 1]
    zero_blocks = jnp.where(total < m_out,
                            pl.cdiv(m_out, cta_tile_m) - total // cta_tile_m,
                            0)
    live_steps = live * n_iters

    @plgpu.nd_loop(((live + zero_blocks) * n_iters,), collective_axes="sm")
    def _mn_loop(info):
      (lin_idx,) = info.index
      is_live = lin_idx < live_steps
      t_idx, n_live = plgpu.planar_snake(
          jnp.where(is_live, lin_idx, 0), (jnp.maximum(live, 1), n_iters),
          minor, c.grid_tile_width)
      z = lin_idx - live_steps
      row_z = (total // cta_tile_m + z // n_iters) * cta_tile_m
      grp = table_gmem[t_idx]
      row = pl.multiple_of(
          jnp.where(is_live, table_gmem[tiles + t_idx], row_z), 8)
      lo = jnp.where(is_live, table_gmem[2 * tiles + t_idx],
                     jnp.maximum(total - row_z, 0))
      hi = jnp.where(is_live, table_gmem[3 * tiles + t_idx],
                     jnp.minimum(m_out - row_z, cta_tile_m))
      n_idx = jnp.where(is_live, n_live, lax.rem(z, jnp.int32(n_iters)))
      # This warpgroup's rows and columns of the CTA tile.
      if c.wg_dimension == "m":
        wg_row, wg_col = wg_idx * tile_m, 0
        wg_m_slice, wg_n_slice = pl.ds(wg_idx * tile_m, tile_m), slice(None)
      else:
        wg_row, wg_col = 0, wg_idx * tile_n
        wg_m_slice, wg_n_slice = slice(None), pl.ds(wg_idx * tile_n, tile_n)
      mine_lo = jnp.clip(lo - wg_row, 0, tile_m)
      mine_hi = jnp.clip(hi - wg_row, 0, tile_m)
      size = mine_hi - mine_lo
      col0 = n_idx * cta_tile_n + wg_col

      def store(block):
        # block(j): this warpgroup's (tile_m, epi_n) values of epilogue
        # column block j.
        for epi_ni in range(tile_n // epi_n):
          # The previous stores out of out_smem must have read it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          out_smem[wg_idx] = block(epi_ni)
          plgpu.commit_smem()
          # Rows [mine_lo, mine_hi) as power-of-two TMA stores, largest
          # first: the set bits of their count.
          start = mine_lo
          step = tile_m
          while step:
            @pl.when((size & step) != 0)
            def _store(start=start, step=step):
              plgpu.copy_smem_to_gmem(
                  out_smem.at[wg_idx, pl.ds(start, step)],
                  out_gmem.at[pl.ds(row + wg_row + start, step),
                              pl.ds(col0 + epi_ni * epi_n, epi_n)])
            start = start + (size & step)
            step //= 2

      def compute_context(eval_pipeline):
        @functools.partial(
            pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...].astype(out_dtype)
          store(lambda j: acc[:, j * epi_n:(j + 1) * epi_n])

      def mma_body(_, x_smem, w_smem, acc_ref):
        if transpose_w:
          w_tile = _transposed(w_smem.at[wg_n_slice, :])
        else:
          w_tile = w_smem.at[:, wg_n_slice]
        plgpu.wgmma(acc_ref, x_smem.at[wg_m_slice], w_tile)
        plgpu.wgmma_wait(0)
        return acc_ref

      cols = pl.ds(n_idx * cta_tile_n, cta_tile_n)

      @pl.when(is_live)
      def _tile():
        get_pipeline(mma_body, compute_context)(
            x_gmem.at[pl.ds(row, cta_tile_m), :],
            w_gmem.at[grp].at[cols, :] if transpose_w else
            w_gmem.at[grp].at[:, cols],
            allocations=pipeline_allocs,
        )

      # Rows past the groups: the compute warpgroups store zeros.
      @pl.when(jnp.logical_not(is_live) & (wg_idx < 2))
      def _zeros():
        store(lambda _: jnp.zeros((tile_m, epi_n), out_dtype))

  # Await all stores before the kernel exits.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_into(x: jax.Array, w: jax.Array, table: jax.Array, *,
                 config: ChunkMatmulConfig | None = None,
                 num_sms: int | None = None,
                 transpose_w: bool = False,
                 counts: tuple[jax.Array, jax.Array] | None = None,
                 interpret_params=None) -> jax.Array:
  """``[M, N]``: row tile t of `table` (``grouped_matmul.tile_table`` with
  ``block_m = config.cta_tile_m``) times ``w[table[0, t]]``, its rows
  ``[lo, hi)`` stored; the rows past the groups are zeros.

  Args:
    x: ``[M, K]`` bf16/f16 rows, M a multiple of 8 (TMA's row tiling).
    w: ``[G, K, N]`` in x's dtype; ``[G, N, K]`` with ``transpose_w``.
    table: ``[4, tiles]`` int32 from ``tile_table(sizes, M, cta_tile_m)``.
    config: the tiles (None: `DEFAULT_CONFIG`).
    num_sms: CTAs of the persistent grid, at most the tiles (None: the
      device's SMs).
    transpose_w: multiply by each ``w[g].T`` as stored (the backward pass's
      ``dx = ct @ w[g].T``), without a transposed copy of w.
    counts: ``(live tiles, groups' rows)`` of the table, int32 scalars,
      where the caller has them (``tile_table``'s sums); None: derived
      from the table here (two more reductions on the device).
    interpret_params: tests only: jax's Mosaic GPU interpreter parameters,
      which run this very kernel on CPU.

  Returns:
    ``[M, N]`` in x's dtype.
  """
  config = config or DEFAULT_CONFIG
  if not isinstance(config, ChunkMatmulConfig):
    raise TypeError(f"config must be a ChunkMatmulConfig, got {config!r}.")
  m, k = x.shape
  w_k, n = (w.shape[2], w.shape[1]) if transpose_w else w.shape[1:]
  if w_k != k:
    layout = "[G, N, K]" if transpose_w else "[G, K, N]"
    raise ValueError(f"w {tuple(w.shape)} does not fit x {tuple(x.shape)}:"
                     f" with transpose_w={transpose_w} w is {layout}, K ="
                     f" {k}.")
  why = unfit(k, n, x.dtype, config)
  if why is not None:
    raise ValueError(f"The grouped Hopper kernel cannot run x {tuple(x.shape)}"
                     f" @ w {tuple(w.shape)} with {config}: {why}.")
  if m % 8:
    raise ValueError(f"x has {m} rows; the grouped Hopper kernel needs a"
                     " multiple of 8 (pad them).")
  if table.shape[0] != 4:
    raise ValueError(f"table must be [4, tiles], got {tuple(table.shape)}.")
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.
  tiles = table.shape[1]
  num_sms = devices.num_sms() if num_sms is None else num_sms
  grid = max(1, min(num_sms, tiles * (n // config.cta_tile_n)))
  kernel = pl.kernel(
      functools.partial(_kernel, config=config, k_iters=k // config.tile_k,
                        tiles=tiles, transpose_w=transpose_w),
      out_type=out_types.out_type((m, n), x.dtype, like=(x, w, table)),
      mesh=plgpu.Mesh(grid=(grid,), grid_names=("sm",), num_threads=3,
                      thread_name="wg"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="ficco_grouped_matmul_hopper",
      interpret=interpret_params or False,
  )
  if counts is None:
    live = jnp.sum(table[3] > table[2], dtype=jnp.int32)
    total = jnp.max(table[1] + table[3])  # The groups' rows.
  else:
    live, total = (jnp.asarray(c, jnp.int32) for c in counts)
  return kernel(jnp.concatenate([table.reshape(-1), live[None], total[None]]),
                x, w.astype(x.dtype))
