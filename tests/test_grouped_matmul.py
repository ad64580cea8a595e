"""The MoE ops' grouped matmul (`grouped_matmul`): its tile table, the
portable kernel on CPU, the Hopper kernel on GPUs, and its gradient."""

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from ficco_jax._src.pallas import grouped_hopper
from ficco_jax._src.pallas import grouped_matmul as gm
from ficco_jax._src.pallas.config import ChunkMatmulConfig

import util

CASES = [  # (rows, group sizes): boundaries inside and on tiles, empties.
    (37, [5, 0, 13, 9]),
    (16, [8, 8]),
    (20, [0, 0, 0]),
    (11, [11]),
    (30, [3, 1, 1, 2, 0, 7]),
]


def _reference(x, w, sizes):
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, c in enumerate(sizes):
    out[start:start + c] = x[start:start + c] @ w[g]
    start += c
  return out


@pytest.mark.parametrize("rows, sizes", CASES)
def test_tile_table_covers_each_routed_row_once(rows, sizes):
  bm = gm.PORTABLE_BLOCK_M
  table = np.asarray(gm.tile_table(jnp.asarray(sizes, jnp.int32), rows, bm))
  assert table.shape == (4, -(-rows // bm) + len(sizes) - 1)
  owner = np.full(rows, -1)
  for grp, row, lo, hi in table.T:
    assert row % bm == 0 and 0 <= lo <= hi <= bm
    for i in range(row + lo, row + hi):
      assert owner[i] == -1, f"row {i} twice"
      owner[i] = grp
  want = np.concatenate([np.full(c, g) for g, c in enumerate(sizes)] +
                        [np.full(rows - sum(sizes), -1)])
  np.testing.assert_array_equal(owner, want)
  # The counts the Hopper kernel takes with it: its live tiles are a prefix
  # of the table, and the groups' rows.
  _, live, total = gm._table_and_counts(  # pylint: disable=protected-access
      jnp.asarray(sizes, jnp.int32), rows, bm)
  is_live = table[3] > table[2]
  assert int(live) == is_live.sum() and is_live[:int(live)].all()
  assert int(total) == sum(sizes)


@pytest.mark.parametrize("rows, sizes", CASES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_portable_kernel_matches_the_reference(rows, sizes, dtype):
  rng = np.random.default_rng(rows)
  x = util.rand(rng, (rows, 24), dtype)
  w = util.rand(rng, (len(sizes), 24, 40), dtype)
  out = gm.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), on_gpu=False)
  assert out.dtype == dtype and out.shape == (rows, 40)
  ref = _reference(x, w, sizes)
  if sum(sizes) == 0:
    assert not np.asarray(out, np.float64).any()
  else:
    assert util.rel_err(out, ref) < util.tol(dtype)
  # Rows past the groups are zero.
  assert not np.asarray(out, np.float64)[sum(sizes):].any()


@pytest.mark.parametrize("on_gpu", [
    False, pytest.param(True, marks=pytest.mark.gpu)])
def test_gradient_matches_ragged_dot(on_gpu):
  rng = np.random.default_rng(3)
  sizes = jnp.asarray([70, 0, 130, 37], jnp.int32)  # 237 of 300 rows.
  dtype = jnp.bfloat16
  x = util.rand(rng, (300, 256), dtype)
  w = (util.rand(rng, (4, 256, 128), np.float32) * 0.1).astype(dtype)
  ct = util.rand(rng, (300, 128), np.float32)
  keep = (np.arange(300) < 237)[:, None]

  def loss(f):
    return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)
  kernel = lambda x, w: gm.grouped_matmul(x, w, sizes, on_gpu=on_gpu)
  xla = lambda x, w: jnp.where(keep, lax.ragged_dot(
      x, w, sizes, preferred_element_type=jnp.float32), 0).astype(dtype)
  out = jax.jit(kernel)(x, w)
  assert util.rel_err(out, _reference(x, w, [70, 0, 130, 37])) < util.tol(dtype)
  got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(xla), argnums=(0, 1)))(x, w)
  for name, g, r in zip(("x", "w"), got, want):
    assert util.rel_err(g, r) < util.tol(dtype), name


@pytest.mark.parametrize("shape, dtype, match", [
    ((256, 128), np.float32, "operands are float32"),
    ((200, 128), jnp.bfloat16, "K=200 is not a multiple of 64"),
    ((256, 96), jnp.bfloat16, "N=96 is not a multiple of 128"),
])
def test_gpu_kernel_rejects_what_it_cannot_run(shape, dtype, match):
  k, n = shape
  x = jnp.zeros((64, k), dtype)
  w = jnp.zeros((2, k, n), dtype)
  with pytest.raises(ValueError, match=match + r".*compute='xla'"):
    gm.grouped_matmul(x, w, jnp.asarray([10, 20], jnp.int32), on_gpu=True)


@pytest.mark.parametrize("x_shape, w_shape, sizes, match", [
    ((16, 4), (2, 4, 3), [4, 4, 4], r"group_sizes must be \[G\] = \[2\]"),
    ((16, 4), (2, 5, 3), [4, 4], r"w must be \[G, K, N\] with K = x.shape\[1\]"
     r" = 4, got shape \(2, 5, 3\)"),
    ((16,), (2, 4, 3), [4, 4], r"x must be \[M, K\], got shape \(16,\)"),
])
def test_shapes_that_do_not_fit_are_errors(x_shape, w_shape, sizes, match):
  with pytest.raises(ValueError, match=match):
    gm.grouped_matmul(jnp.ones(x_shape), jnp.ones(w_shape),
                      jnp.asarray(sizes, jnp.int32), on_gpu=False)


def test_weight_gradient_keeps_the_f32_cotangent():
  """bf16 operands, f32 result: dw comes from the unrounded cotangent, and
  rows past the groups (another peer's, in the MoE ops) add nothing."""
  rng = np.random.default_rng(5)
  sizes = jnp.asarray([9, 0, 14], jnp.int32)  # 23 of 30 rows.
  x = util.rand(rng, (30, 16), jnp.bfloat16)
  w = util.rand(rng, (3, 16, 24), jnp.bfloat16)
  ct = rng.standard_normal((30, 24)).astype(np.float32)  # Nonzero past 23.
  keep = (np.arange(30) < 23)[:, None]
  kernel = lambda w: jnp.sum(gm.grouped_matmul(
      x, w, sizes, out_dtype=jnp.float32, on_gpu=False) * ct)
  xla = lambda w: jnp.sum(jnp.where(keep, lax.ragged_dot(
      x, w, sizes, preferred_element_type=jnp.float32), 0) * ct)
  got = np.asarray(jax.grad(kernel)(w.astype(np.float32)), np.float64)
  want = np.asarray(jax.grad(xla)(w.astype(np.float32)), np.float64)
  assert util.rel_err(got, want) < 1e-6


@pytest.mark.parametrize("kw, match", [
    (dict(block_m=100), "block_m=100 must be a multiple of 64"),
    (dict(grid_block_n=0), "grid_block_n=0 must be a positive int"),
])
def test_block_is_validated(kw, match):
  with pytest.raises(ValueError, match=match):
    gm.Block(**kw)
  with pytest.raises(TypeError, match="block must be a grouped_matmul.Block"):
    gm.grouped_matmul(jnp.ones((8, 64)), jnp.ones((1, 64, 128)),
                      jnp.asarray([8], jnp.int32), block=(128, 128))


@pytest.mark.parametrize("k, n, cta_n", [
    (4096, 14336, 256),  # mixtral-8x7b's up.
    (14336, 4096, 256),
    (2048, 1408, 128),   # deepseek-v2-lite: N = 11 x 128.
    (1408, 2048, 256),
    (2048, 768, 256),    # qwen3-30b-a3b: N = 3 x 256.
])
def test_choose_block_takes_ficco_kernel_with_the_widest_tile_that_fits(
    k, n, cta_n):
  b = gm.choose_block(k, n, jnp.bfloat16)
  assert isinstance(b, ChunkMatmulConfig)
  assert b.cta_tile_n == cta_n
  assert gm.mosaic_unfit(k, n, jnp.bfloat16, b) is None
  assert grouped_hopper.smem_bytes(b, jnp.bfloat16, jnp.bfloat16) <= (
      227 * 1024 - 1024)


def test_choose_block_gives_a_width_no_tile_divides_the_smallest_tile():
  # Whose error then names the misfit.
  assert gm.choose_block(4096, 100, jnp.bfloat16) == gm.HOPPER_CONFIGS[-1]
  assert "N=100 is not a multiple of 128" in gm.mosaic_unfit(
      4096, 100, jnp.bfloat16)


def test_gpu_kernel_gets_fitting_tiles_forward_and_for_the_gradient(
    monkeypatch):
  # The GPU kernel stands in as a recorder (no GPU here): block=None picks
  # tiles per call, and the gradient's dx swaps K and N (1408 = 11 x 128
  # takes the 128-column tile, 512 the 256-column one).
  seen = []

  def fake(x, w, table, *, config, num_sms=None, transpose_w=False,
           counts=None):
    del table, num_sms, counts
    if transpose_w:  # dx reads w where it lies, [G, N, K].
      w = jnp.swapaxes(w, 1, 2)
    k, n = w.shape[1:]
    assert grouped_hopper.unfit(k, n, x.dtype, config) is None
    seen.append((k, n, config.cta_tile_n, transpose_w))
    return jnp.einsum("mk,kn->mn", x, w[0])

  monkeypatch.setattr(grouped_hopper, "grouped_into", fake)
  # dw goes to the transposed kernel (here a recorder too).
  monkeypatch.setattr(gm, "mosaic_dw", lambda x, ct, sizes: seen.append(
      ("dw", x.shape, ct.shape)) or jnp.zeros((1, 512, 1408), x.dtype))
  x = jnp.ones((8, 512), jnp.bfloat16)
  w = jnp.ones((1, 512, 1408), jnp.bfloat16)
  sizes = jnp.asarray([8], jnp.int32)
  jax.grad(lambda x, w: gm.grouped_matmul(x, w, sizes, on_gpu=True).astype(
      jnp.float32).sum(), argnums=(0, 1))(x, w)
  assert seen == [(512, 1408, 128, False), (1408, 512, 256, True),
                  ("dw", (8, 512), (8, 1408))]


@pytest.mark.parametrize("wg, minor, sizes", [
    # Boundaries inside both warpgroups' rows, an empty group, dead tiles
    # at the end (232 of 256 rows routed), a band width that does not
    # divide the tiles.
    ("m", "m", [37, 0, 150, 45]),
    # Warpgroups side by side: every cut tile's rows go out from both; a
    # one-row group (the ladder's smallest store).
    ("n", "n", [1, 127, 0, 120]),
    # Most rows past the groups: zeros stored over two row blocks, one of
    # them shared with the last group.
    ("m", "n", [10, 0, 5, 20]),
    # Every row routed (no zero blocks); no row routed (zeros only).
    ("n", "m", [64, 0, 100, 92]),
    ("m", "m", [0, 0, 0, 0]),
    # w read transposed where it lies (the gradient's dx) is GPU-only
    # (test_gpu_gradient_dx_reads_w_transposed): the interpreter of jax
    # 0.10.2 takes no transposed refs (a worker raises and the others wait
    # at a barrier for ever).
])
def test_hopper_grouped_kernel_in_mosaic_gpu_interpreter(monkeypatch, wg,
                                                         minor, sizes):
  # ficco's grouped Hopper kernel itself (warp-specialized TMA/wgmma
  # pipeline, tiles from the table, the ladder of row stores, the zeros
  # past the groups) under jax's Mosaic GPU interpreter on CPU, whose fresh
  # buffers hold NaN.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = ChunkMatmulConfig(tile_m=64, tile_n=64, max_concurrent_steps=2,
                          epi_tile_m=64, epi_tile_n=64, wg_dimension=wg,
                          grid_minor_dim=minor, grid_tile_width=3)
  rng = np.random.default_rng(11)
  # Rows a multiple of the tiles: the interpreter refuses the reads past
  # the end that TMA fills with zeros on a GPU (the GPU test has them).
  m, k, n = 256, 128, 2 * cfg.cta_tile_n
  x = util.rand(rng, (m, k), jnp.bfloat16)
  w = (util.rand(rng, (len(sizes), k, n), np.float32) * k ** -0.5).astype(
      jnp.bfloat16)
  table = gm.tile_table(jnp.asarray(sizes, jnp.int32), m, cfg.cta_tile_m)
  out = grouped_hopper.grouped_into(x, w, table, config=cfg, num_sms=3,
                                    interpret_params=params)
  routed = sum(sizes)
  ref = _reference(x, w, sizes)
  assert util.rel_err(np.asarray(out, np.float64)[:routed],
                      ref[:routed]) < util.tol(jnp.bfloat16)
  assert not np.asarray(out, np.float64)[routed:].any()


@pytest.mark.parametrize("what, kw, match", [
    ("f32", dict(dtype=np.float32), "operands are float32"),
    ("k", dict(k=96), "K=96 is not a multiple of 64"),
    ("n", dict(n=384), "N=384 is not a multiple of 256"),
    ("rows", dict(m=20), "x has 20 rows; .* multiple of 8"),
    ("smem", dict(config=ChunkMatmulConfig(tile_m=128, tile_n=256,
                                           epi_tile_m=128, epi_tile_n=256)),
     "bytes of shared memory"),
    ("epilogue", dict(config=ChunkMatmulConfig(epi_tile_n=32)),
     "64-byte rows of the epilogue tile"),
])
def test_hopper_grouped_kernel_rejects_what_it_cannot_run(what, kw, match):
  del what
  m, k, n = kw.get("m", 64), kw.get("k", 128), kw.get("n", 512)
  dtype = kw.get("dtype", jnp.bfloat16)
  x = jnp.zeros((m, k), dtype)
  w = jnp.zeros((2, k, n), dtype)
  table = gm.tile_table(jnp.asarray([10, 20], jnp.int32), m, 128)
  with pytest.raises(ValueError, match=match):
    grouped_hopper.grouped_into(x, w, table, config=kw.get("config"),
                                num_sms=4)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [
    gm.HOPPER_CONFIGS[0], gm.HOPPER_CONFIGS[1],
    dataclasses.replace(gm.HOPPER_CONFIGS[0], grid_minor_dim="n",
                        grid_tile_width=5),
    gm.Block(grid_block_n=2)],
    ids=lambda b: getattr(b, "cta_tile_n", None) and
    f"ws{b.cta_tile_m}x{b.cta_tile_n}{b.grid_minor_dim}" or "jax")
def test_gpu_grouped_kernels_on_random_routing(block):
  # Compiled on the GPU: random group sizes (an empty group, a one-row
  # group, boundaries anywhere), rows not a multiple of 8 and unrouted rows
  # at the end, many pipeline steps (K = 1984 = 31 x 64).
  rng = np.random.default_rng(17)
  m, k, n, g = 3001, 1984, 1024, 6
  cuts = np.sort(rng.integers(0, 2900, g - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [2900]])).astype(np.int32)
  sizes[3] += sizes[2]  # Group 2 empty,
  sizes[2] = 0
  sizes[4] += sizes[0] - 1  # group 0 one row.
  sizes[0] = 1
  assert sizes.sum() == 2900 and sizes.min() >= 0
  x = jnp.asarray(util.rand(rng, (m, k), jnp.bfloat16))
  w = (util.rand(rng, (g, k, n), np.float32) * k ** -0.5).astype(
      jnp.bfloat16)
  x = x.at[2900:].set(jnp.nan)  # Unrouted: never read into a routed row.
  out = jax.jit(lambda x, w: gm.grouped_matmul(
      x, w, jnp.asarray(sizes), block=block))(x, w)
  _check_rows(out, _reference(x[:2900], w, sizes), 2900)


def _check_rows(out, ref, routed):
  """Every routed row within bf16's tolerance of its own reference row (a
  norm over all rows would let a dropped row through), the rest 0."""
  got = np.asarray(out, np.float64)
  err = (np.linalg.norm(got[:routed] - ref[:routed], axis=1)
         / np.linalg.norm(ref[:routed], axis=1))
  assert err.max() < util.tol(jnp.bfloat16), (err.argmax(), err.max())
  assert not got[routed:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    gm.HOPPER_CONFIGS[0],
    ChunkMatmulConfig(tile_m=64, tile_n=128, epi_tile_m=64, epi_tile_n=64,
                      wg_dimension="n", grid_minor_dim="n",
                      grid_tile_width=3),
    ChunkMatmulConfig(tile_m=128, tile_n=128, max_concurrent_steps=3,
                      epi_tile_m=128, epi_tile_n=128)],
    ids=["default", "wg_n", "tile_m128"])
@pytest.mark.parametrize("m", [40, 1000])
def test_gpu_grouped_kernel_runs_many_tiles_per_cta(config, m):
  # Seven CTAs for dozens of tiles: each CTA reuses its epilogue tile and
  # restarts the pipeline, and stores the zeros past the groups; 40 rows
  # are fewer than one CTA tile (reads past the end of x).
  rng = np.random.default_rng(29)
  k, n = 320, 4 * config.cta_tile_n
  sizes = np.asarray([m // 3, 0, 1, m // 2], np.int32)
  routed = int(sizes.sum())
  x = jnp.asarray(util.rand(rng, (m, k), jnp.bfloat16))
  x = x.at[routed:].set(jnp.nan)
  w = (util.rand(rng, (4, k, n), np.float32) * k ** -0.5).astype(
      jnp.bfloat16)
  table = gm.tile_table(jnp.asarray(sizes), m, config.cta_tile_m)
  out = jax.jit(lambda x, w, t: grouped_hopper.grouped_into(
      x, w, t, config=config, num_sms=7))(x, w, table)
  _check_rows(out, _reference(x[:routed], w, sizes), routed)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [
    gm.HOPPER_CONFIGS[0], gm.HOPPER_CONFIGS[-1],
    ChunkMatmulConfig(tile_m=64, tile_n=128, epi_tile_m=64, epi_tile_n=64,
                      wg_dimension="n", grid_minor_dim="n",
                      grid_tile_width=3),
    gm.Block(grid_block_n=2)],
    ids=["default", "n128", "wg_n", "jax"])
def test_gpu_gradient_dx_reads_w_transposed(block):
  # The backward pass's dx = ct @ w[g].T with w as it lies ([G, K, N]):
  # every routed row of dx against its f64 reference, the rest 0, with NaN
  # in the cotangent's rows past the groups.
  rng = np.random.default_rng(41)
  m, k, n = 1000, 512, 768
  sizes = np.asarray([300, 0, 1, 421, 150], np.int32)
  routed = int(sizes.sum())
  w = (util.rand(rng, (5, k, n), np.float32) * n ** -0.5).astype(
      jnp.bfloat16)
  ct = jnp.asarray(util.rand(rng, (m, n), jnp.bfloat16))
  ct = ct.at[routed:].set(jnp.nan)
  dx = jax.jit(lambda ct, w: gm._impl(  # pylint: disable=protected-access
      ct, w, jnp.asarray(sizes), jnp.bfloat16, True, block,
      transpose_w=True))(ct, w)
  _check_rows(dx, _reference(ct[:routed], np.swapaxes(np.asarray(
      w, np.float32), 1, 2), sizes), routed)


@pytest.mark.gpu
def test_gpu_weight_gradient_kernel_on_random_routing():
  # jax's transposed grouped kernel as the gradient runs it: random group
  # boundaries (inside its 64-row steps), an empty group (its tiles must
  # read 0), NaN in the unrouted rows at the end (which its masks multiply
  # by 0).
  rng = np.random.default_rng(23)
  m, k, n = 1500, 384, 640
  sizes = np.asarray([301, 0, 555, 97, 400], np.int32)  # 1353 rows.
  x = jnp.asarray(util.rand(rng, (m, k), jnp.bfloat16))
  ct = jnp.asarray(util.rand(rng, (m, n), jnp.bfloat16))
  ct = gm.zero_past_groups(ct, jnp.asarray(sizes))
  assert gm.dw_unfit(k, n, x.dtype, x.dtype) is None
  xs, cs = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  x = x.at[1353:].set(jnp.nan)
  got = np.asarray(jax.jit(gm.mosaic_dw)(x, ct, jnp.asarray(sizes)),
                   np.float64)
  start = 0
  for i, c in enumerate(sizes):
    want = xs[start:start + c].T @ cs[start:start + c]
    if c:
      assert util.rel_err(got[i], want) < util.tol(jnp.bfloat16), i
    else:
      assert not got[i].any()
    start += c


@pytest.mark.parametrize("k, n, dtype, w_dtype, match", [
    (256, 128, np.float32, np.float32, "operands are float32"),
    (256, 128, jnp.bfloat16, np.float32, "w is float32, the rows bfloat16"),
    (192, 128, jnp.bfloat16, jnp.bfloat16, "K=192 is not a multiple of 128"),
    (256, 64, jnp.bfloat16, jnp.bfloat16, "N=64 is not a multiple of 128"),
])
def test_weight_gradient_kernel_says_what_it_cannot_run(k, n, dtype,
                                                        w_dtype, match):
  assert match in gm.dw_unfit(k, n, dtype, w_dtype)
