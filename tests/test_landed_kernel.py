"""The kernel that waits on landing flags (the signalled all-gather's).

`chunk_matmul_pieces(..., landed=(flags, index))` launches the Hopper
kernel while its ``x`` is still being written by copy queues; each CTA
waits in the kernel for a piece's flag before it loads the piece. One GPU
tests it against the late-landing hook (`dma/late_landing.py`), which
lands a buffer piece by piece on a side stream after a delay; the window
transport's landing flags, which need two GPUs, are covered by the ops
harness (tests/test_ops.py, `flagged` with ``compute="pallas"``). On CPU:
the hook's twin, the argument checks, and the kernel's plumbing under
jax's Mosaic GPU interpreter (which cannot wait: the wait is skipped).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ficco_jax._src.dma import late_landing as hook
from ficco_jax._src.pallas import chunk_matmul as cm
from ficco_jax._src.pallas import hopper
from ficco_jax._src.pallas import offsets
import util


def _pieces_ref(x, x_rows, rows, w):
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  return [xf[r:r + rows] @ wf for r in x_rows]


def test_late_landing_hook_lands_every_piece():
  # On CPU at once; on a GPU after the delay, seen once the call is done.
  rng = np.random.default_rng(50)
  x = jnp.asarray(rng.standard_normal((40, 12)), jnp.float32)
  def land(x):
    landing, flags, src = hook.late_landing(x, [8, 24, 8], delay_ms=5)
    return landing, hook.join(flags), src

  landing, flags, src = jax.jit(land)(x)
  np.testing.assert_array_equal(np.asarray(landing), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(flags), [1, 1, 1])
  np.testing.assert_array_equal(np.asarray(src), np.asarray(x))


@pytest.mark.parametrize("rows,delay", [([8, 8, 8], 0), ([0, 16], 0),
                                        ([16], -1), ([8, 4], 0)])
def test_late_landing_hook_rejects_bad_arguments(rows, delay):
  with pytest.raises(ValueError, match="rows=|delay_ms="):
    hook.late_landing(jnp.zeros((16, 4)), rows, delay_ms=delay)


def test_landed_needs_the_hopper_kernel():
  # An interpreted launch cannot wait in the kernel: refused, not ignored.
  x, w = jnp.ones((16, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
  flags = jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match="landed needs the Hopper kernel"):
    cm.chunk_matmul_pieces(x, [0, 8], 8, w, landed=(flags, [0, 1]),
                           interpret=True)
  with pytest.raises(ValueError, match="one flag per piece"):
    cm.chunk_matmul_pieces(x, [0, 8], 8, w, landed=(flags, [0]),
                           interpret=True)


def test_landed_kernel_in_mosaic_gpu_interpreter(monkeypatch):
  # The kernel's plumbing (the flags operand between x's and out, the
  # piece-by-piece walk, rows placed into an aliased out) under jax's
  # Mosaic GPU interpreter, which skips the wait itself: three pieces read
  # out of order from x, written at their owners' rows, 5 CTAs over 2
  # tiles a piece.
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  cfg = cm.ChunkMatmulConfig(tile_m=64, tile_n=64, max_concurrent_steps=2)
  rows, k, n = cfg.cta_tile_m, 128, 2 * cfg.cta_tile_n
  rng = np.random.default_rng(51)
  x = jnp.asarray(rng.standard_normal((3 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  out = jnp.full((4 * rows, n), jnp.nan, jnp.bfloat16)
  x_rows, out_rows = [rows, 2 * rows, 0], [3 * rows, 0, rows]
  result = hopper.mgpu_into(
      out, x, w, offsets.piece_offsets(out_rows, x_rows), num_sms=5,
      config=cfg, rows=3 * rows, landed=jnp.ones((4,), jnp.int32),
      landed_index=(2, 0, 3), mosaic_interpret=params)
  got = np.asarray(result, np.float64)
  for r, ref in zip(out_rows, _pieces_ref(x, x_rows, rows, w)):
    rel = np.linalg.norm(got[r:r + rows] - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, (r, rel)
  assert np.isnan(got[2 * rows:3 * rows]).all()  # No piece goes there.


def test_mgpu_into_checks_landed(monkeypatch):
  params = util.mosaic_gpu_interpret_params(monkeypatch)
  x = jnp.zeros((256, 128), jnp.bfloat16)
  w = jnp.zeros((128, 128), jnp.bfloat16)
  off = offsets.piece_offsets([0, 128], [0, 128])
  kw = dict(num_sms=2, config=None, rows=256, out_dtype=jnp.bfloat16,
            mosaic_interpret=params)
  with pytest.raises(ValueError, match="must give each of the 2 pieces"):
    hopper.mgpu_into(None, x, w, off, landed=jnp.ones((2,), jnp.int32),
                     landed_index=(0, 2), **kw)
  with pytest.raises(TypeError, match="landed must be int32"):
    hopper.mgpu_into(None, x, w, off, landed=jnp.ones((2,), jnp.float32),
                     landed_index=(0, 1), **kw)
  with pytest.raises(ValueError, match="landed_index needs landed"):
    hopper.mgpu_into(None, x, w, off, landed_index=(0, 1), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [None, 3])
def test_gpu_kernel_waits_for_pieces_that_land_late(num_sms):
  # x lands 200 ms after the kernel is launched, piece by piece: a kernel
  # that waits computes the product of what landed; one that does not
  # reads the zeros the hook wrote first (the control: this test can fail).
  if jax.devices()[0].platform != "gpu":
    pytest.skip("needs a GPU (one is enough)")
  rows, k, n = 384, 320, 640
  rng = np.random.default_rng(52)
  x = jnp.asarray(rng.standard_normal((3 * rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  x_rows = [0, rows, 2 * rows]

  @functools.partial(jax.jit, static_argnums=2)
  def run(x, w, wait):
    landing, flags, src = hook.late_landing(x, [rows] * 3, delay_ms=200)
    y = cm.chunk_matmul_pieces(
        landing, x_rows, rows, w, num_sms=num_sms,
        landed=(flags, [0, 1, 2]) if wait else None)
    # The control's copies land after its kernel: joined before the
    # buffers go back to XLA.
    return hook.join(y), src

  for _ in range(2):  # Flags are zeroed per call.
    got, _ = run(x, w, True)
    got = np.asarray(got, np.float64)
    for i, ref in enumerate(_pieces_ref(x, x_rows, rows, w)):
      rel = np.linalg.norm(got[i * rows:(i + 1) * rows] - ref) / np.linalg.norm(ref)
      assert rel < 1e-2, (i, rel)
  early, _ = run(x, w, False)
  assert np.abs(np.asarray(early, np.float64)[2 * rows:]).max() == 0


@pytest.mark.multigpu
@pytest.mark.parametrize("num_chunks,landed_wait", [(1, False), (2, False),
                                                    (2, True)])
def test_window_start_sets_a_landing_flag_per_transfer(num_chunks,
                                                       landed_wait):
  # The protocol's part: a window start with landing flags zeroes them and
  # each copy queue sets its transfer's flag once the piece has landed,
  # call after call on the same window; read after a plain wait, or after
  # done behind a landed wait (which only waits for the copies to be
  # enqueued: on GPUs a kernel waits on the flags after it).
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from ficco_jax import Schedule  # pylint: disable=g-import-not-at-top
  from ficco_jax._src import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  mesh = util.tp_mesh()
  p, m = mesh.devices.size, 4 * num_chunks
  gplan = plan_lib.gather_plan(
      Schedule(dataflow="direct", num_chunks=num_chunks, comm="dma"),
      axis_size=p, shard_rows=m)
  kw = dict(axis_name="x", op_name="landed_test", timeout_s=30.0,
            transport="window")

  def body(x0):
    site = peer_copy.new_site()
    *landings, flags = peer_copy.start([x0], gplan, site=site, landed=True,
                                       **kw)
    landings = [peer_copy.wait(b, site=site, landed=landed_wait, **kw)
                for b in landings]
    flags = peer_copy.done(flags, [x0, *landings], site=site, **kw)
    # Read the landings after the done, which waits for every copy.
    flags, landings = jax.lax.optimization_barrier((flags, landings))
    return jnp.concatenate(landings, 0), flags

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                            out_specs=(P("x"), P("x"))))
  rng = np.random.default_rng(53)
  for _ in range(3):
    x = jax.device_put(
        jnp.asarray(rng.standard_normal((p * m, 3)), jnp.float32),
        jax.sharding.NamedSharding(mesh, P("x")))
    gathered, flags = f(x)
    np.testing.assert_array_equal(np.asarray(flags),
                                  np.ones(p * len(gplan.transfers)))
    # Rank r's landing holds its peers' chunks in plan order.
    got = np.asarray(gathered).reshape(p, -1, 3)
    xs = np.asarray(x).reshape(p, m, 3)
    for r in range(p):
      want = [xs[(r + t.src_offset) % p][t.src_row:t.src_row + t.rows]
              for t in gplan.transfers]
      np.testing.assert_array_equal(got[r], np.concatenate(want, 0))
