"""The MoE ops' grouped matmul (`grouped_matmul`): its tile table, the
portable kernel on CPU, the Hopper kernel on GPUs, and its gradient."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from ficco_jax._src.pallas import grouped_matmul as gm

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
  if on_gpu and not util.on_gpu():
    pytest.skip("needs a GPU")
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


@pytest.mark.parametrize("k, n, want", [
    (4096, 14336, 4),  # mixtral-8x7b's up: N a multiple of 4 x 128.
    (14336, 4096, 4),
    (2048, 1408, 1),   # deepseek-v2-lite: N = 11 x 128 takes one block.
    (1408, 2048, 4),
    (2048, 768, 2),    # qwen3-30b-a3b: N = 3 x 256.
])
def test_choose_block_takes_the_widest_grid_that_fits(k, n, want):
  b = gm.choose_block(k, n, jnp.bfloat16)
  assert b.grid_block_n == want
  assert gm.mosaic_unfit(k, n, jnp.bfloat16, b) is None


def test_choose_block_gives_a_width_no_tile_divides_the_smallest_tile():
  # Whose error then names the misfit.
  assert gm.choose_block(4096, 100, jnp.bfloat16) == gm.BLOCK
  assert "N=100 is not a multiple of 128" in gm.mosaic_unfit(
      4096, 100, jnp.bfloat16)


def test_gpu_kernel_gets_fitting_tiles_forward_and_for_the_gradient(
    monkeypatch):
  # The GPU kernel stands in as a recorder (no GPU here): block=None picks
  # tiles per call, and the gradient's dx swaps K and N (1408 = 11 x 128
  # takes one column block, 512 takes four).
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=g-import-not-at-top
  seen = []

  def fake(x, w, *, group_sizes, block_m, block_n, block_k,
           max_concurrent_steps, grid_block_n):
    del group_sizes, block_m, block_k, max_concurrent_steps
    k, n = w.shape[1:]
    assert n % (block_n * grid_block_n) == 0, (n, block_n, grid_block_n)
    seen.append((k, n, grid_block_n))
    return jnp.einsum("mk,kn->mn", x, w[0])

  monkeypatch.setattr(ragged_dot_mgpu, "ragged_dot", fake)
  x = jnp.ones((8, 512), jnp.bfloat16)
  w = jnp.ones((1, 512, 1408), jnp.bfloat16)
  sizes = jnp.asarray([8], jnp.int32)
  jax.grad(lambda x: gm.grouped_matmul(x, w, sizes, on_gpu=True).astype(
      jnp.float32).sum())(x)
  assert seen == [(512, 1408, 1), (1408, 512, 4)]
