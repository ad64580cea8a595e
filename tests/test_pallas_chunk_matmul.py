"""Tests of the Pallas chunk matmul, on CPU.

The portable kernel runs in Pallas interpret mode; the Hopper kernel itself
runs under jax's Mosaic GPU interpreter where this jax has one. They check the
chunk/offset logic: the product lands in rows [row_offset, row_offset + mc) of
out, every other row keeps its (poisoned) value, and a traced offset under jit
and shard_map works. Single device only.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from ficco_jax._src.pallas import chunk_matmul as cm
from ficco_jax._src.pallas import config as pallas_config
from ficco_jax._src.pallas import hopper
from ficco_jax._src.pallas import offsets

import util

POISON = -12345.0  # Exactly representable in bf16, f16 and f32.
# On a GPU host the interpreter's f32 dots run on the GPU, as tf32.
_F32 = 1e-5 if jax.default_backend() == "cpu" else 1e-3
TOL = {jnp.float32: _F32, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _inputs(seed, m, mc, k, n, dtype, out_dtype=None):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((mc, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)), dtype)
  out = jnp.full((m, n), POISON, out_dtype or dtype)
  return out, x, w


def _check(result, out, x, w, off, tol):
  result = np.asarray(result, np.float64)
  mc = x.shape[0]
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  got = result[off:off + mc]
  rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  assert rel < tol, f"relative error {rel} >= {tol}"
  # Untouched rows keep exactly their poisoned value.
  np.testing.assert_array_equal(result[:off], np.asarray(out, np.float64)[:off])
  np.testing.assert_array_equal(result[off + mc:],
                                np.asarray(out, np.float64)[off + mc:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "m,mc,k,n,off",
    [
        (30, 6, 40, 24, 18),   # odd sizes, offset not a multiple of mc
        (30, 6, 40, 24, 0),    # first rows
        (30, 6, 40, 24, 24),   # last rows
        (17, 17, 9, 5, 0),     # whole output, prime sizes
        (64, 16, 8, 300, 37),  # n > one column block (two blocks of 150)
        (300, 130, 16, 8, 150),  # mc > one row block (two blocks of 65)
    ],
)
def test_into_static_offset(dtype, m, mc, k, n, off):
  out, x, w = _inputs(0, m, mc, k, n, dtype)
  result = cm.chunk_matmul_into(out, x, w, off, interpret=True)
  assert result.shape == out.shape and result.dtype == out.dtype
  _check(result, out, x, w, off, TOL[dtype])


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="interpret=None compiles the Hopper kernel off CPU")
def test_interpret_none_is_interpret_on_cpu():
  out, x, w = _inputs(1, 30, 6, 40, 24, jnp.float32)
  _check(cm.chunk_matmul_into(out, x, w, 18), out, x, w, 18, TOL[jnp.float32])


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_out_dtype_differs_from_inputs(out_dtype):
  out, x, w = _inputs(2, 30, 6, 40, 24, jnp.bfloat16, out_dtype)
  result = cm.chunk_matmul_into(out, x, w, 12, interpret=True,
                                preferred_element_type=out_dtype)
  assert result.dtype == out_dtype
  _check(result, out, x, w, 12, TOL[jnp.bfloat16])


def test_traced_offset_under_jit():
  m, mc, k, n = 30, 6, 40, 24
  out, x, w = _inputs(3, m, mc, k, n, jnp.float32)

  @jax.jit
  def f(out, x, w, chunk):
    return cm.chunk_matmul_into(out, x, w, chunk * mc, interpret=True)

  for chunk in (0, 3, 4):
    result = f(out, x, w, jnp.int32(chunk))
    _check(result, out, x, w, chunk * mc, TOL[jnp.float32])


def test_chunks_fill_output_in_a_loop():
  # The way the dataflows use it: each chunk written in place into one buffer.
  m, mc, k, n = 24, 6, 16, 8
  rng = np.random.default_rng(4)
  xs = jnp.asarray(rng.standard_normal((m // mc, mc, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)

  @jax.jit
  def f(xs, w):
    def body(c, out):
      return cm.chunk_matmul_into(out, xs[c], w, c * mc, interpret=True)
    return jax.lax.fori_loop(0, m // mc, body,
                             jnp.full((m, n), jnp.nan, jnp.float32))

  ref = np.asarray(xs, np.float64).reshape(m, k) @ np.asarray(w, np.float64)
  got = np.asarray(f(xs, w), np.float64)
  # Relative norm: on GPU hosts the interpreter's f32 dot is tf32, whose
  # rounding an elementwise bound on near-zero entries cannot absorb.
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < _F32


def test_chunk_matmul_and_reference():
  _, x, w = _inputs(5, 6, 6, 40, 24, jnp.float32)
  y = cm.chunk_matmul(x, w, interpret=True)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert y.shape == (6, 24) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), ref, rtol=_F32, atol=10 * _F32)
  out = jnp.zeros((30, 24), jnp.float32)
  r = cm._reference(out, x, w, 18)
  np.testing.assert_allclose(np.asarray(r)[18:24], ref, rtol=_F32, atol=10 * _F32)
  assert not np.asarray(r)[:18].any() and not np.asarray(r)[24:].any()


def test_lowers_with_aliasing():
  # The kernel's result is out itself: one aliased operand, no extra
  # dynamic_update_slice around the kernel.
  out, x, w = _inputs(6, 30, 6, 40, 24, jnp.float32)
  f = jax.jit(lambda o, x, w: cm.chunk_matmul_into(o, x, w, 18, interpret=True),
              donate_argnums=0)
  compiled = f.lower(out, x, w).compile()
  assert compiled is not None  # Aliasing and donation lower and compile.


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "shapes,off,exc,match",
    [
        (((30, 24), (6, 40), (41, 24)), 0, ValueError, "contracting"),
        (((30, 25), (6, 40), (40, 24)), 0, ValueError, "columns"),
        (((30, 24), (6, 40), (40, 24)), 25, ValueError, r"row_offset=25"),
        (((30, 24), (6, 40), (40, 24)), -1, ValueError, r"row_offset=-1"),
        (((4, 24), (6, 40), (40, 24)), 0, ValueError, "more than out"),
        (((30, 24, 1), (6, 40), (40, 24)), 0, ValueError, "out must be 2-D"),
    ],
)
def test_shape_errors(shapes, off, exc, match):
  out, x, w = (jnp.zeros(s, jnp.float32) for s in shapes)
  with pytest.raises(exc, match=match):
    cm.chunk_matmul_into(out, x, w, off, interpret=True)


def test_dtype_errors():
  out = jnp.zeros((30, 24), jnp.float32)
  x = jnp.zeros((6, 40), jnp.bfloat16)
  w = jnp.zeros((40, 24), jnp.float32)
  with pytest.raises(TypeError, match="must match"):
    cm.chunk_matmul_into(out, x, w, 0, interpret=True)
  with pytest.raises(TypeError, match="x.dtype=int32"):
    cm.chunk_matmul_into(out, x.astype(jnp.int32), w.astype(jnp.int32), 0,
                         interpret=True)
  x = x.astype(jnp.float32)
  with pytest.raises(TypeError, match="preferred_element_type"):
    cm.chunk_matmul_into(out, x, w, 0, interpret=True,
                         preferred_element_type=jnp.bfloat16)
  with pytest.raises(TypeError, match="row_offset"):
    cm.chunk_matmul_into(out, x, w, jnp.float32(0), interpret=True)
  with pytest.raises(TypeError, match="row_offset"):
    cm.chunk_matmul_into(out, x, w, jnp.zeros((2,), jnp.int32),
                         interpret=True)
  with pytest.raises(ValueError, match="num_sms"):
    cm.chunk_matmul_into(out, x, w, 0, interpret=True, num_sms=0)


def test_compiled_on_cpu_is_an_error():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  out, x, w = _inputs(7, 30, 6, 40, 24, jnp.float32)
  with pytest.raises(ValueError, match="needs a GPU"):
    cm.chunk_matmul_into(out, x, w, 0, interpret=False)


# ------------------------------------------------------------------ config


def test_config_is_frozen_hashable_and_validated():
  cfg = cm.ChunkMatmulConfig()
  assert hash(cfg) == hash(cm.ChunkMatmulConfig())
  assert (cfg.cta_tile_m, cfg.cta_tile_n) == (128, 256)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.tile_m = 64  # type: ignore[misc]
  with pytest.raises(TypeError):
    cm.ChunkMatmulConfig(128)  # type: ignore[misc]  # keyword-only
  with pytest.raises(ValueError, match="tile_m"):
    cm.ChunkMatmulConfig(tile_m=96)
  with pytest.raises(ValueError, match="epi_tile_n"):
    cm.ChunkMatmulConfig(tile_n=128, epi_tile_n=48)
  with pytest.raises(ValueError, match="tile_n"):
    cm.ChunkMatmulConfig(tile_n=96)
  with pytest.raises(ValueError, match="wg_dimension"):
    cm.ChunkMatmulConfig(wg_dimension="k")  # type: ignore[arg-type]


@pytest.mark.parametrize("mc,k,n", [(512, 8192, 7168), (4096, 7168, 8192),
                                    (128, 64, 64), (192, 128, 384)])
def test_default_config_divides_and_fits(mc, k, n):
  cfg = cm.default_config(mc, k, n)
  cfg.check_shapes(mc, n, k)
  assert (cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16)
          <= pallas_config.SMEM_BUDGET)


def test_default_config_rejects_unaligned_shapes():
  with pytest.raises(ValueError, match="mc=6"):
    cm.default_config(6, 40, 24)
  with pytest.raises(ValueError, match="mc=64"):
    cm.default_config(64, 64, 64)
  with pytest.raises(ValueError, match="mc=576"):
    cm.ChunkMatmulConfig(tile_m=128, wg_dimension="m").check_shapes(512 + 64, 256, 64)


# ------------------------------------------------- Hopper kernel, on CPU


@pytest.mark.parametrize(
    "tile_m,tile_n,wg,num_sms",
    [(64, 256, "m", 3),   # the default 128x256 CTA tile; 4 tiles on 3 CTAs
     (64, 192, "m", 2),   # 128x192 (the wave-filling tile for n % 256 != 0)
     (128, 128, "n", 4)],  # warpgroups split along n
)
def test_hopper_kernel_in_mosaic_gpu_interpreter(monkeypatch, tile_m, tile_n,
                                                 wg, num_sms):
  # Runs the Hopper kernel itself (warp-specialized TMA/wgmma pipeline,
  # persistent loop over tiles, TMA stores at a run-time row offset) under
  # jax's Mosaic GPU interpreter on CPU.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=tile_m, tile_n=tile_n, wg_dimension=wg,
                             max_concurrent_steps=2)
  mc, k, n = 2 * cfg.cta_tile_m, 128, 2 * cfg.cta_tile_n
  out, x, w = _inputs(8, 3 * mc, mc, k, n, jnp.bfloat16)
  out = out.at[:].set(jnp.nan)
  result = hopper.mgpu_into(out, x, w, offsets.offset_operand(mc),
                            num_sms=num_sms, config=cfg,
                            mosaic_interpret=params)
  result = np.asarray(result, np.float64)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  rel = np.linalg.norm(result[mc:2 * mc] - ref) / np.linalg.norm(ref)
  assert rel < 1e-2
  assert np.isnan(result[:mc]).all() and np.isnan(result[2 * mc:]).all()


@pytest.mark.gpu  # The compiled Hopper kernel (the interpreter test above
                  # runs it on CPU, where TMA and wgmma are serial).
@pytest.mark.parametrize("minor,width", [("n", 1), ("n", 4), ("m", 8)])
def test_hopper_kernel_tile_orders_on_gpu(minor, width):
  # Tile orders other than the picked one (the kernel benchmark times
  # them): many steps (K = 1984, 31 of them) and more tiles than SMs,
  # so every CTA runs the pipeline for several tiles, and band widths that
  # do not divide the 10 x 9 tile grid.
  cfg = dataclasses.replace(cm.default_config(1280, 1984, 2304),
                            grid_minor_dim=minor, grid_tile_width=width)
  out, x, w = _inputs(23, 1536, 1280, 1984, 2304, jnp.bfloat16)
  result = cm.chunk_matmul_into(out, x, w, 128, config=cfg, num_sms=37)
  _check(result, out, x, w, 128, TOL[jnp.bfloat16])


def test_inside_shard_map_with_axis_index_offset():
  # The dataflows' use: the offset comes from lax.axis_index inside
  # shard_map. One device, so this does not depend on the device count.
  # check_vma=False: jax 0.10.2's Pallas interpreter rejects any kernel under
  # check_vma=True (the compiled Hopper kernel lowers either way).
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  m, mc, k, n = 30, 6, 40, 24
  out, x, w = _inputs(9, m, mc, k, n, jnp.float32)

  def body(out, x, w):
    off = (jax.lax.axis_index("x") + 3) * mc
    return cm.chunk_matmul_into(out, x, w, off, interpret=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()),
                            out_specs=P(), check_vma=False))
  _check(f(out, x, w), out, x, w, 18, TOL[jnp.float32])


# ------------------------------------------- rows read in place (RS pieces)


@pytest.mark.parametrize("off", [0, 12, 35])
def test_chunk_matmul_rows_reads_the_rows_it_names(off):
  rng = np.random.default_rng(21)
  x = jnp.asarray(rng.standard_normal((47, 10)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((10, 7)), jnp.float32)
  f = jax.jit(lambda x, w, off: cm.chunk_matmul_rows(x, off, 12, w,
                                                     interpret=True))
  got = np.asarray(f(x, w, jnp.int32(off)), np.float64)
  ref = np.asarray(x, np.float64)[off:off + 12] @ np.asarray(w, np.float64)
  assert got.shape == (12, 7)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL[jnp.float32]


@pytest.mark.parametrize("rows", [0, 48, 2.0])
def test_chunk_matmul_rows_rejects_bad_rows(rows):
  x, w = jnp.zeros((47, 10)), jnp.zeros((10, 7))
  with pytest.raises(ValueError, match="rows="):
    cm.chunk_matmul_rows(x, 0, rows, w)


def test_default_config_takes_half_depth_steps_for_odd_k():
  # qwen2-72b's reduce-scatter contracts over 29568 / 4 = 7392 = 115.5 x 64.
  cfg = cm.default_config(1024, 7392, 8192)
  assert cfg.tile_k == 32
  cfg.check_shapes(1024, 8192, 7392)
  assert cm.default_config(1024, 7168, 8192).tile_k == 64


def test_pad_k_zero_fills_to_whole_steps():
  x = jnp.ones((2, 3, 7392), jnp.bfloat16)
  p = cm.pad_k(x)
  assert p.shape == (2, 3, 7424) and cm.padded_k(7392) == 7424
  assert (np.asarray(p[..., 7392:], np.float32) == 0).all()
  assert (np.asarray(p[..., :7392], np.float32) == 1).all()
  for k in (7168, 100):  # Whole steps already; not a 16-byte row.
    assert cm.padded_k(k) == k and cm.pad_k(jnp.ones((1, k))).shape == (1, k)


def test_chunk_matmul_pieces_rejects_a_wrongly_padded_x():
  f32 = jnp.float32
  x, w = jnp.zeros((16, 100), f32), jnp.zeros((96, 8), f32)
  with pytest.raises(ValueError, match="padded_k"):
    cm.chunk_matmul_pieces(x, [0], 8, w, x_zero_padded_k=True)
  with pytest.raises(ValueError, match="K"):
    cm.chunk_matmul_pieces(jnp.zeros((16, 128), f32), [0], 8, w)


@pytest.mark.parametrize("k", [96, 7392])
def test_pieces_of_a_zero_padded_x(k):
  # K = 96 / 7392 (qwen2-72b's shard) leave half a 64-deep step over: x is
  # zero-padded to whole steps, w is not. On a GPU the Hopper kernel reads
  # past w's rows (TMA fills zeros there); on CPU the portable kernel reads
  # x's first K columns (the Mosaic GPU interpreter models no TMA fill).
  rng = np.random.default_rng(k)
  rows, n = 128, 256
  x = jnp.asarray(rng.standard_normal((3 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  kw = dict(interpret=jax.default_backend() != "gpu")
  xp = cm.pad_k(x)
  assert xp.shape[1] % 64 == 0
  got = cm.chunk_matmul_pieces(xp, [2 * rows, 0], rows, w,
                               x_zero_padded_k=True, **kw)
  ref = np.concatenate([np.asarray(x, np.float64)[r:r + rows]
                        @ np.asarray(w, np.float64) for r in (2 * rows, 0)])
  got = np.asarray(got, np.float64)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("tile_k,k", [(64, 128), (32, 96)])
def test_hopper_kernel_reads_rows_in_place_in_mosaic_gpu_interpreter(
    monkeypatch, tile_k, k):
  # The reduce-scatter's use: rows [x_row, x_row + rows) of a taller operand,
  # TMA-loaded at a run-time row, into a fresh output (every tile written);
  # tile_k=32: 64-byte swizzled steps, for K not a multiple of 64.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=64, tile_n=128, tile_k=tile_k,
                             max_concurrent_steps=2)
  rows, n = 2 * cfg.cta_tile_m, 2 * cfg.cta_tile_n
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((3 * rows + 8, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  x_row = rows + 8
  result = hopper.mgpu_into(None, x, w, offsets.offset_operand(0, x_row),
                            num_sms=3, config=cfg, rows=rows,
                            out_dtype=jnp.bfloat16, mosaic_interpret=params)
  assert result.shape == (rows, n)
  ref = np.asarray(x, np.float64)[x_row:x_row + rows] @ np.asarray(w, np.float64)
  got = np.asarray(result, np.float64)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


# ------------------------------------- several pieces in one launch (steps)


def _pieces_ref(x, x_rows, rows, w):
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  return [x64[r:r + rows] @ w64 for r in x_rows]


def test_chunk_matmul_pieces_stacks_rows_read_in_place():
  # The reduce-scatter's step on rank 2 of 4: the pieces of ranks 3, 0, 1,
  # i.e. rows that wrap around the operand; traced offsets under jit.
  rng = np.random.default_rng(31)
  m = 6
  x = jnp.asarray(rng.standard_normal((4 * m, 10)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((10, 7)), jnp.float32)
  starts = [3 * m + 1, 0 * m + 1, 1 * m + 1]
  f = jax.jit(lambda x, w, s: cm.chunk_matmul_pieces(x, list(s), 4, w,
                                                     interpret=True))
  got = np.asarray(f(x, w, jnp.asarray(starts, jnp.int32)), np.float64)
  ref = np.concatenate(_pieces_ref(x, starts, 4, w))
  assert got.shape == (12, 7)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < TOL[jnp.float32]


def test_chunk_matmul_pieces_writes_each_piece_at_its_row():
  rng = np.random.default_rng(32)
  x = jnp.asarray(rng.standard_normal((9, 5)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
  out = jnp.full((20, 3), POISON, jnp.float32)
  got = np.asarray(cm.chunk_matmul_pieces(x, [0, 3, 6], 3, w, out=out,
                                          out_rows=[15, 0, 9],
                                          interpret=True), np.float64)
  for (dst, ref) in zip([15, 0, 9], _pieces_ref(x, [0, 3, 6], 3, w)):
    assert np.linalg.norm(got[dst:dst + 3] - ref) / np.linalg.norm(ref) < 1e-5
  untouched = np.ones(20, bool)
  for dst in (15, 0, 9):
    untouched[dst:dst + 3] = False
  assert (got[untouched] == POISON).all()


def test_chunk_matmul_pieces_rejects_bad_arguments():
  x, w = jnp.zeros((12, 4), jnp.float32), jnp.zeros((4, 3), jnp.float32)
  with pytest.raises(ValueError, match="x_rows must name"):
    cm.chunk_matmul_pieces(x, [], 4, w)
  with pytest.raises(ValueError, match="rows=13"):
    cm.chunk_matmul_pieces(x, [0], 13, w)
  with pytest.raises(ValueError, match=r"x_rows\[1\]=10 with rows=4"):
    cm.chunk_matmul_pieces(x, [0, 10], 4, w)
  with pytest.raises(ValueError, match=r"out_rows\[0\]=6 with rows=4"):
    cm.chunk_matmul_pieces(x, [0], 4, w, out=jnp.zeros((8, 3), jnp.float32),
                           out_rows=[6])
  with pytest.raises(TypeError, match=r"x_rows\[0\] must be an int"):
    cm.chunk_matmul_pieces(x, [jnp.float32(0)], 4, w)
  with pytest.raises(ValueError, match="num_sms=0"):
    cm.chunk_matmul_pieces(x, [0], 4, w, num_sms=0)
  with pytest.raises(ValueError, match="out and out_rows go together"):
    cm.chunk_matmul_pieces(x, [0], 4, w, out=jnp.zeros((8, 3), jnp.float32))
  with pytest.raises(ValueError, match="out_rows has 1 entries"):
    cm.chunk_matmul_pieces(x, [0, 4], 4, w,
                           out=jnp.zeros((8, 3), jnp.float32),
                           out_rows=[0])


@pytest.mark.parametrize("into", [False, True])
def test_hopper_kernel_pieces_in_mosaic_gpu_interpreter(monkeypatch, into):
  # Three pieces of two CTA tile rows each, read from wrapped-around rows of
  # x (the reduce-scatter's step) into a fresh output, or written at
  # scattered rows of an aliased out (the all-gather's step); on 3 CTAs, so
  # CTAs cross piece boundaries in their tile loop.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=64, tile_n=128, max_concurrent_steps=2)
  rows, k, n = 2 * cfg.cta_tile_m, 128, cfg.cta_tile_n
  rng = np.random.default_rng(33)
  x = jnp.asarray(rng.standard_normal((4 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  x_rows = [3 * rows, 0, rows]
  out_rows = [2 * rows, 0, 3 * rows] if into else [0, rows, 2 * rows]
  out = jnp.full((4 * rows, n), jnp.nan, jnp.bfloat16) if into else None
  result = hopper.mgpu_into(out, x, w, offsets.piece_offsets(out_rows, x_rows),
                            num_sms=3, config=cfg, rows=3 * rows,
                            out_dtype=jnp.bfloat16, mosaic_interpret=params)
  got = np.asarray(result, np.float64)
  assert got.shape == ((4 * rows, n) if into else (3 * rows, n))
  for dst, ref in zip(out_rows, _pieces_ref(x, x_rows, rows, w)):
    rel = np.linalg.norm(got[dst:dst + rows] - ref) / np.linalg.norm(ref)
    assert rel < 1e-2
  if into:
    assert np.isnan(got[rows:2 * rows]).all()


# ------------------------------------------- offsets given per rank (ByRank)


def test_by_rank_validates_its_table():
  with pytest.raises(ValueError, match="one non-empty row per rank"):
    cm.ByRank(jnp.int32(0), [[0, 8], [8]])
  with pytest.raises(ValueError, match="one non-empty row per rank"):
    cm.ByRank(jnp.int32(0), [])
  with pytest.raises(TypeError, match="x_rows.rank must be an int or an integer scalar array"):
    cm.chunk_matmul_pieces(jnp.zeros((16, 8), jnp.float32),
                           cm.ByRank(jnp.float32(0), [[0], [8]]), 8,
                           jnp.zeros((8, 4), jnp.float32))
  with pytest.raises(ValueError, match=r"x_rows\[1\]=12 with rows=8"):
    cm.chunk_matmul_pieces(jnp.zeros((16, 8), jnp.float32),
                           cm.ByRank(jnp.int32(0), [[0], [12]]), 8,
                           jnp.zeros((8, 4), jnp.float32))


def test_chunk_matmul_pieces_by_rank_reads_each_ranks_rows():
  # Each rank's pieces come from the table row of its own rank: the traced
  # rank selects it (interpret mode, as in the reduce-scatter's shard_map).
  rng = np.random.default_rng(5)
  p, rows = 3, 8
  x = jnp.asarray(rng.standard_normal((p * 2 * rows, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
  table = [[(r + 1) % p * 2 * rows, r * 2 * rows + rows] for r in range(p)]
  for r in range(p):
    got = cm.chunk_matmul_pieces(x, cm.ByRank(jnp.int32(r), table), rows, w,
                                 interpret=True)
    ref = np.concatenate(_pieces_ref(x, table[r], rows, w), 0)
    # f32 dots run as tf32 on GPUs: a relative-norm tolerance that fits.
    rel = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
    assert rel < (3e-3 if jax.default_backend() == "gpu" else 1e-5), (r, rel)


@pytest.mark.parametrize("into", [False, True])
def test_hopper_kernel_by_rank_offsets_in_mosaic_gpu_interpreter(monkeypatch,
                                                                into):
  # The Hopper kernel with ByRank offsets: the table is compiled in and the
  # one run-time operand is the rank, so ranks 0 and 2 of one compiled
  # kernel must read (and write) their own rows.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=64, tile_n=128, max_concurrent_steps=2)
  rows, k, n = cfg.cta_tile_m, 128, cfg.cta_tile_n
  rng = np.random.default_rng(34)
  x = jnp.asarray(rng.standard_normal((4 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  x_table = [[(r + 1) % 3 * rows, (r + 2) % 3 * rows + rows] for r in range(3)]
  out_table = [[3 * rows, r * rows] for r in range(3)]
  for r in (0, 2):
    out_rows = (cm.ByRank(jnp.int32(r), out_table) if into
                else [0, rows])
    off = offsets.by_rank_offsets(out_rows, cm.ByRank(jnp.int32(r), x_table))
    out = jnp.full((4 * rows, n), jnp.nan, jnp.bfloat16) if into else None
    result = hopper.mgpu_into(out, x, w, off, num_sms=2, config=cfg,
                              rows=2 * rows, out_dtype=jnp.bfloat16,
                              mosaic_interpret=params)
    got = np.asarray(result, np.float64)
    dests = out_table[r] if into else [0, rows]
    for dst, ref in zip(dests, _pieces_ref(x, x_table[r], rows, w)):
      rel = np.linalg.norm(got[dst:dst + rows] - ref) / np.linalg.norm(ref)
      assert rel < 1e-2, (r, dst, rel)


@pytest.mark.parametrize(
    "variant,num_sms,n_tiles,walk,target",
    [(("piece", "piece_end"), 3, 2, ("n", 1), 2 * 3),
     (("rows", "piece_end"), 3, 2, ("n", 1), 2 * 3),
     (("piece", "tile"), 3, 2, ("n", 1), 2 * 4),
     # Fewer tiles per piece (2) than CTAs (5): some CTAs skip pieces.
     (("piece", "piece_end"), 5, 1, ("n", 1), 2 * 2),
     # The config's walk inside a piece: m-minor bands two tiles wide.
     (("piece", "piece_end"), 3, 2, ("m", 2), 2 * 3)])
def test_hopper_kernel_flags_count_each_piece_in_mosaic_gpu_interpreter(
    monkeypatch, variant, num_sms, n_tiles, walk, target):
  # The flagged kernel's bump logic: every piece's flag must reach
  # flag_target exactly, whichever CTA runs which tile. Three pieces of two
  # tile rows x n_tiles tile columns; with 4 tiles a piece and 3 CTAs, CTA
  # 0 runs tiles 0, 3, 6, 9 (pieces 0, 0, 1, 2), CTA 1 pieces 0, 1, 1, 2,
  # CTA 2 pieces 0, 1, 2, 2, so each CTA leaves pieces at different tiles.
  # "piece_end" bumps once per CTA with tiles in the piece and warpgroup
  # (2 x min(tiles, CTAs)), "tile" once per tile and warpgroup. The
  # interpreter counts per (CTA, warpgroup) (no atomics there) and poisons
  # a flag that one of them bumped twice under "piece_end".
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=64, tile_n=64, max_concurrent_steps=2,
                             grid_minor_dim=walk[0], grid_tile_width=walk[1])
  rows, k, n = 2 * cfg.cta_tile_m, 128, n_tiles * cfg.cta_tile_n
  rng = np.random.default_rng(35)
  x = jnp.asarray(rng.standard_normal((3 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  x_rows = [2 * rows, 0, rows]
  off = offsets.piece_offsets([0, rows, 2 * rows], x_rows)
  flags = jnp.full((3,), 5, jnp.int32)  # Counts add to what is there.
  result, got_flags, got_target = hopper.mgpu_into(
      None, x, w, off, num_sms=num_sms, config=cfg, rows=3 * rows,
      out_dtype=jnp.bfloat16, flags=flags, flag_variant=variant,
      mosaic_interpret=params)
  assert got_target == target
  np.testing.assert_array_equal(np.asarray(got_flags), [5 + target] * 3)
  got = np.asarray(result, np.float64)
  for i, ref in enumerate(_pieces_ref(x, x_rows, rows, w)):
    rel = np.linalg.norm(got[i * rows:(i + 1) * rows] - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, (i, rel)


# ------------------------------------------ addends and fresh placed output


def test_chunk_matmul_pieces_adds_addends_and_places_pieces():
  # The reduce-scatter's own rows: the product plus the pulled partials
  # (one of them a slot of a larger buffer), written into one result chunk
  # by chunk (interpret mode).
  rng = np.random.default_rng(41)
  x = jnp.asarray(rng.standard_normal((40, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((24, 12)), jnp.float32)
  a = jnp.asarray(rng.standard_normal((8, 12)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((24, 12)), jnp.float32)
  first = cm.chunk_matmul_pieces(x, [16], 8, w, addends=[a, b],
                                 addend_rows=[0, 16], out_rows=[0],
                                 fresh_rows=16, interpret=True)
  both = cm.chunk_matmul_pieces(x, [24], 8, w, addends=[b], out=first,
                                out_rows=[8], interpret=True)
  xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = np.concatenate([xs[16:24] @ ws + np.asarray(a) + np.asarray(b)[16:],
                         xs[24:32] @ ws + np.asarray(b)[:8]])
  assert both.shape == (16, 12)
  rel = np.linalg.norm(np.asarray(both, np.float64) - want) / np.linalg.norm(want)
  # f32 dots run as tf32 on GPUs.
  assert rel < (3e-3 if jax.default_backend() == "gpu" else 1e-6), rel


def test_chunk_matmul_pieces_rejects_bad_addends():
  x, w = jnp.zeros((16, 8), jnp.float32), jnp.zeros((8, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"addends\[0\].shape=\(8, 5\) must be"):
    cm.chunk_matmul_pieces(x, [0], 8, w, addends=[jnp.zeros((8, 5), jnp.float32)])
  with pytest.raises(ValueError, match=r"addend_rows\[0\]=4 with the result's 8 rows"):
    cm.chunk_matmul_pieces(x, [0], 8, w, addends=[jnp.zeros((8, 4), jnp.float32)],
                           addend_rows=[4])
  with pytest.raises(ValueError, match="addend_rows has 2 entries"):
    cm.chunk_matmul_pieces(x, [0], 8, w, addends=[jnp.zeros((8, 4), jnp.float32)],
                           addend_rows=[0, 0])
  with pytest.raises(TypeError, match="addend_rows must hold static ints"):
    cm.chunk_matmul_pieces(x, [0], 8, w, addends=[jnp.zeros((8, 4), jnp.float32)],
                           addend_rows=[jnp.int32(0)])
  with pytest.raises(ValueError, match="fresh_rows needs out=None and out_rows"):
    cm.chunk_matmul_pieces(x, [0], 8, w, fresh_rows=16)
  with pytest.raises(ValueError, match="fresh_rows=4 must be an int of at least rows=8"):
    cm.chunk_matmul_pieces(x, [0], 8, w, out_rows=[0], fresh_rows=4)
  with pytest.raises(ValueError, match=r"out_rows\[0\]=12 with rows=8"):
    cm.chunk_matmul_pieces(x, [0], 8, w, out_rows=[12], fresh_rows=16)


@pytest.mark.parametrize("by_rank", [False, True])
def test_hopper_kernel_adds_addends_in_mosaic_gpu_interpreter(monkeypatch,
                                                             by_rank):
  # The epilogue loads each addend's tile from GMEM into registers and adds
  # it to the f32 accumulator before rounding: a fresh result placed at a
  # row (the other rows unwritten), then a second piece written into it.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=64, tile_n=128, max_concurrent_steps=2)
  rows, k, n = 2 * cfg.cta_tile_m, 128, cfg.cta_tile_n
  rng = np.random.default_rng(35)
  x = jnp.asarray(rng.standard_normal((3 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((2 * rows, n)), jnp.bfloat16)

  def off(dest, src):
    if by_rank:  # Rank 1 of a two-rank table, as in the reduce-scatter.
      return offsets.by_rank_offsets([dest], cm.ByRank(jnp.int32(1),
                                                        [[0], [src]]))
    return offsets.piece_offsets([dest], [src])

  first = hopper.mgpu_into(None, x, w, off(rows, 2 * rows), num_sms=3,
                           config=cfg, rows=rows, out_dtype=jnp.bfloat16,
                           addends=[a, b], addend_rows=[0, rows],
                           fresh_rows=2 * rows, mosaic_interpret=params)
  assert first.shape == (2 * rows, n)
  both = hopper.mgpu_into(first, x, w, off(0, 0), num_sms=3, config=cfg,
                          rows=rows, addends=[b], addend_rows=[0],
                          mosaic_interpret=params)
  f64 = lambda v: np.asarray(v, np.float64)
  want = [f64(x[:rows]) @ f64(w) + f64(b[:rows]),
          f64(x[2 * rows:]) @ f64(w) + f64(a) + f64(b[rows:])]
  got = f64(both)
  for i, ref in enumerate(want):
    part = got[i * rows:(i + 1) * rows]
    rel = np.linalg.norm(part - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, (i, rel)


def test_hopper_kernel_with_addends_lowers_for_cuda():
  # The interpreter reads the addends with a plain load; the compiled
  # kernel needs plgpu.load's element-wise path (a plain read of GMEM into
  # the wgmma layout does not lower). Lowering for CUDA runs on any host.
  from jax import export  # pylint: disable=g-import-not-at-top

  def f(x, w, a, b):
    return hopper.mgpu_into(None, x, w, offsets.piece_offsets([256], [128]),
                            num_sms=None, config=None, rows=256,
                            out_dtype=jnp.bfloat16, addends=[a, b],
                            addend_rows=[0, 256], fresh_rows=512)

  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  exported = export.export(jax.jit(f), platforms=["cuda"])(
      s(512, 1024), s(1024, 512), s(256, 512), s(512, 512))
  assert exported.out_avals[0].shape == (512, 512)
  assert "ficco_chunk_matmul_into" in exported.mlir_module()
