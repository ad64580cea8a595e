"""The Hopper chunk-matmul kernel (Mosaic GPU: wgmma + TMA).

Warp specialized (one warpgroup issues TMA loads, two issue ``wgmma``),
persistent over a grid of at most ``num_sms`` CTAs that loop over the output
tiles of the chunk. The epilogue TMA-stores each tile at ``row_offset + tile
row`` of the full output (a TMA descriptor over all of ``out``, dynamic
coordinates), so the dynamic offset costs nothing. One launch may compute
several row pieces (`offsets.piece_offsets`), add addends in its epilogue,
and bump a flag per piece once its rows are stored (`gmem_flags.signal`).

Constraints (checked, with a ValueError/TypeError naming the argument):
bf16/f16 operands; the CTA tile must divide each piece exactly -- its rows
and n multiples of 64 (128 for most tiles) -- because a partial tile would
be TMA-stored over the next piece's rows (no masking); row offsets multiples
of 8 (TMA transfers of 8-row tiled shared memory). Mosaic GPU tiles the GMEM
operand as it tiles shared memory, so x's K must be a multiple of the step
depth: a K that is not a multiple of 64 takes half-depth steps, or a
zero-padded x (`config.pad_k`, ``x_zero_padded_k``) with w read past its
rows (TMA fills zeros). On an H200 the kernel matches or beats cuBLAS (XLA's
dot) on the llama3/gpt3 chunk shapes with mc >= 512 (the ``kernel``
benchmark suite).

Mosaic GPU is imported inside the functions, so this module imports on a
jaxlib without it; the tests run the kernel on CPU under jax's Mosaic GPU
interpreter (`mgpu_into`'s ``mosaic_interpret``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ficco_jax._src import devices
from ficco_jax._src.pallas import out_types
from ficco_jax._src.pallas.config import ChunkMatmulConfig
from ficco_jax._src.pallas.config import default_config
from ficco_jax._src.pallas.config import flag_target
from ficco_jax._src.pallas.config import MGPU_DTYPES
from ficco_jax._src.pallas.config import padded_k
from ficco_jax._src.pallas.offsets import ByRank


def operand_pipeline(config: ChunkMatmulConfig, k_iters: int, dtype,
                     transpose_w: bool = False):
  """``get(body, compute_context)``: the warp-specialized pipeline of
  ficco's Hopper kernels (this one and `grouped_hopper`): one memory
  warpgroup TMA-loads a CTA's ``(cta_tile_m, tile_k)`` block of x and
  ``(tile_k, cta_tile_n)`` block of w per step into swizzled shared memory,
  ``max_concurrent_steps`` deep, for two compute warpgroups; called on
  x's rows and w's columns of the CTA's tile, over ``k_iters`` steps.
  ``transpose_w``: w is stored ``[n, K]`` and called on its rows of the
  tile; its ``(cta_tile_n, tile_k)`` blocks are K-minor like x's, for
  ``wgmma`` to read transposed (`grouped_hopper._transposed`)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.
  c = config
  swizzle = plgpu.find_swizzle(c.tile_k * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  transforms = (plgpu.TilingTransform((8, swizzle_elems)),
                plgpu.SwizzleTransform(swizzle))

  # w's block and where step kk finds it: K-major, or K-minor like x's.
  w_block, w_index = (((c.cta_tile_n, c.tile_k), lambda kk: (0, kk))
                      if transpose_w else
                      ((c.tile_k, c.cta_tile_n), lambda kk: (kk, 0)))

  def get(pipeline_body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        pipeline_body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((c.cta_tile_m, c.tile_k), lambda kk: (0, kk),
                            transforms=transforms, memory_space=plgpu.SMEM),
            plgpu.BlockSpec(w_block, w_index, transforms=transforms,
                            memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=c.max_concurrent_steps,
        compute_context=compute_context,
    )
  return get


def _select(i, values):
  """``values[i]`` (int32) for a traced ``i`` in ``[0, len(values))``, by a
  chain of selects over the few static choices: inside the kernel that
  needs no table in memory and no dynamic scalar load."""
  v = jnp.asarray(values[0], jnp.int32)
  for q in range(1, len(values)):
    v = jnp.where(i == q, jnp.asarray(values[q], jnp.int32), v)
  return v


def _mgpu_kernel(off_gmem, x_gmem, w_gmem, *rest, config, k_iters, mc,
                 pieces, rank_table=None, addend_rows=(), interpreted=False,
                 flagged=False, num_ctas=1, flag_walk="piece",
                 flag_bump="piece_end", landed_index=None):
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
  #           its stores of that piece are complete (gmem_flags.signal; see
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
  # landed_index: per piece, the index of its landing flag: rest holds
  #           landed_gmem (int32, GMEM, read only) after the addends, and a
  #           CTA waits until the piece's flag is set (a copy queue writes it
  #           once the piece has landed in x) before its first tile of the
  #           piece; the tiles are walked piece by piece, so the CTAs start
  #           on piece 0 while later pieces are still in flight.
  import jax.experimental.pallas.mosaic_gpu as plgpu  # GPU-only import.

  # rest: the addends, landed_gmem, flags_gmem, out_gmem (each if used).
  addend_gmems = list(rest)
  out_gmem = addend_gmems.pop()
  flags_gmem = addend_gmems.pop() if flagged else None
  landed_gmem = addend_gmems.pop() if landed_index is not None else None

  if flagged:
    from ficco_jax._src.pallas import gmem_flags  # pylint: disable=g-import-not-at-top

    def bump(piece):
      if interpreted:
        # jax's Mosaic GPU interpreter has no atomics and no rule for
        # gmem_flags.signal: each (CTA, compute warpgroup) counts into its own
        # slot of a (pieces, CTAs, 2) buffer, which mgpu_into checks and
        # sums, so the tests check the bump logic on CPU.
        at = (piece, lax.axis_index("sm"), lax.axis_index("wg"))
        flags_gmem[at] = flags_gmem[at] + 1
      else:
        gmem_flags.signal(flags_gmem, piece)

  dtype = x_gmem.dtype
  out_dtype = out_gmem.dtype
  n = w_gmem.shape[1]
  c = config
  tile_m, tile_n = c.tile_m, c.tile_n
  cta_tile_m, cta_tile_n = c.cta_tile_m, c.cta_tile_n
  m_iters, n_iters = mc // cta_tile_m, n // cta_tile_n
  epi_tile_m, epi_tile_n = c.epi_tile_m, c.epi_tile_n
  tiles_per_piece = m_iters // pieces

  # One epilogue slot suffices when a warpgroup has a single epilogue tile.
  num_out_slots = min(2, (tile_m * tile_n) // (epi_tile_m * epi_tile_n))
  out_swizzle = plgpu.find_swizzle(epi_tile_n * jnp.dtype(out_dtype).itemsize * 8)
  out_swizzle_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
  out_transforms = (plgpu.TilingTransform((8, out_swizzle_elems)),
                    plgpu.SwizzleTransform(out_swizzle))
  minor = 0 if c.grid_minor_dim == "m" else 1
  get_pipeline = operand_pipeline(c, k_iters, dtype)

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
        # The ranks' compiled-in offsets (a few ranks).
        return _select(rank, [table[q] for table in rank_table])
    if pieces == 1:
      out_base, x_base = off_at(0), off_at(1)

    def tile_rows(m_idx):
      """First rows of tile row m_idx in out and in x."""
      if pieces == 1:
        piece_out, piece_x, within = out_base, x_base, m_idx
      else:
        # Pieces <= 8 or so: a select needs no dynamic scalar load.
        piece = m_idx // tiles_per_piece
        within = m_idx - piece * tiles_per_piece
        piece_out = _select(piece, [off_at(q) for q in range(pieces)])
        piece_x = _select(piece, [off_at(pieces + q) for q in range(pieces)])
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

    def await_landed(lin):
      # Once per CTA and piece, before its first tile's loads: every
      # warpgroup passes the wait (the memory warpgroup issues the loads;
      # the others are cheap to hold there too).
      piece = piece_of(lin)
      first = (lin < num_ctas) | (piece_of(lin - num_ctas) != piece)

      @pl.when(first)
      def _():
        if interpreted:
          # jax's Mosaic GPU interpreter has no rule for the wait; its
          # callers hand it pieces that have landed (chunk_matmul).
          return
        from ficco_jax._src.pallas import gmem_flags  # pylint: disable=g-import-not-at-top
        gmem_flags.wait(landed_gmem, _select(piece, landed_index))

    @plgpu.nd_loop((num_tiles,), collective_axes="sm")
    def _mn_loop(info):
      # jax 0.10+ passes an NDLoopInfo; older versions a tuple of indices.
      (lin_idx,) = getattr(info, "index", info)
      if landed_gmem is not None:
        await_landed(lin_idx)
      if (flagged or landed_gmem is not None) and flag_walk == "piece":
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


def mgpu_into(out, x, w, off, *, num_sms, config, off_static=None,
              mosaic_interpret=None, rows=None, out_dtype=None,
              addends=(), addend_rows=(), fresh_rows=None, flags=None,
              flag_variant=("piece", "piece_end"), landed=None,
              landed_index=None):
  """The Hopper kernel: for each of the ``len(off) // 2`` pieces ``i`` of
  ``rows / pieces`` rows, ``x[off[P + i]:][:rows / P] @ w`` into rows
  ``off[i]:`` of ``out`` (aliased), or of a fresh ``[rows, n]`` array when
  ``out`` is None (every tile is written, so nothing needs zeroing first),
  or of a fresh ``[fresh_rows, n]`` array (rows no piece covers are left
  unwritten). ``off`` may be a `ByRank` of the same ``2 * pieces`` offsets
  per rank. Row ``t`` of the product (pieces stacked) gets
  ``addends[i][addend_rows[i] + t]`` added for every ``i``, in f32 before
  rounding. With ``landed`` (int32 flags in device memory) each CTA waits
  until ``landed[landed_index[i]] >= 1`` before it loads piece ``i``'s
  rows of x: x is still being written by copy queues that set each flag
  once their piece has landed."""
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
  if jnp.dtype(x.dtype) not in MGPU_DTYPES:
    raise TypeError(
        f"x.dtype={x.dtype}: the Hopper kernel takes bfloat16 or float16"
        " operands (wgmma from shared memory); use compute='xla' for float32.")
  device_sms = devices.num_sms()
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
  if landed is not None:
    landed_index = tuple(int(i) for i in landed_index or ())
    if landed.ndim != 1 or landed.dtype != jnp.int32:
      raise TypeError(f"landed must be int32[flags], got {landed.dtype}"
                      f"{list(landed.shape)}.")
    if len(landed_index) != pieces or not all(
        0 <= i < landed.shape[0] for i in landed_index):
      raise ValueError(
          f"landed_index={landed_index} must give each of the {pieces}"
          f" pieces a flag of landed ({landed.shape[0]} of them).")
    if flag_walk != "piece":
      raise ValueError("landed pieces are walked piece by piece: flag_variant"
                       f" must walk 'piece', got {flag_walk!r}.")
  elif landed_index is not None:
    raise ValueError("landed_index needs landed.")
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
                        flag_walk=flag_walk, flag_bump=flag_bump,
                        landed_index=(landed_index if landed is not None
                                      else None)),
      out_type=(() if out is not None
                # A fresh_rows result is written into by later calls (a
                # Ref), which jax >= 0.11 allows only typed invariant; the
                # caller restores its type (vma.vary_like).
                else out_types.invariant_out_type((fresh_rows, n), out_dtype)
                if fresh_rows is not None
                else out_types.out_type((mc, n), out_dtype, like=(x, w, off))),
      mesh=plgpu.Mesh(grid=(grid,), grid_names=("sm",),
                      num_threads=3, thread_name="wg"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="ficco_chunk_matmul_into",
      interpret=mosaic_interpret or False,
  )
  if landed is not None:
    addends = (*addends, landed)  # Read after the addends (_mgpu_kernel).
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
