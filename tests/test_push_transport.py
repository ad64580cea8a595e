"""The flagged reduce-scatter over the push protocol (docs/windows.md,
"Push"), the default transport of compute_granularity="flagged": each rank
pushes its pieces into the owners' windows, and each owner adds them to its
own rows with the finish's own sum. The schedules here name
``transport="push"``, so that they keep testing push whatever the default.
The CPU twin runs here; the CUDA handlers on the GPUs.
"""

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.dma import library
from ficco_jax._src.dma import windows

import util

TIMEOUT_S = 30.0


pytestmark = pytest.mark.multigpu


def _platform():
  return "cuda" if util.on_gpu() else "cpu"


def _tp_mesh():
  """An "x" axis of 4 devices, or of every device where there are 2 or 3
  (a 2-GPU machine runs the protocol too)."""
  n = min(4, len(util.test_devices()))
  return util.mesh((max(n, 2),), ("x",))


def _op(num_chunks, timeout_s=TIMEOUT_S, transport="push"):
  """The flagged matmul_reduce_scatter over axis "x", for shard_map."""
  sched = Schedule(dataflow="direct", num_chunks=num_chunks, comm="dma",
                   compute="pallas", compute_granularity="flagged",
                   transport=transport)
  return functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                           schedule=sched, timeout_s=timeout_s)


def _rs(mesh, num_chunks, timeout_s=TIMEOUT_S, transport="push"):
  """jit(shard_map(flagged matmul_reduce_scatter)) over the mesh's last
  axis "x"; a leading "d" axis, if any, splits the rows (dp x tp)."""
  op = _op(num_chunks, timeout_s, transport)
  rows = tuple(mesh.axis_names)  # ("x",) or ("d", "x")
  lead = rows[:-1] or (None,)
  return jax.jit(jax.shard_map(
      op, mesh=mesh, in_specs=(P(*lead, "x"), P("x")),
      out_specs=P(rows), check_vma=util.on_gpu()))


def _shapes(dtype):
  if util.on_gpu():
    # Pieces must be whole Hopper tiles: 768 rows per device, 3 chunks.
    return jnp.bfloat16, 768, 256, 128
  return dtype, 6, 10, 7


def _args(mesh, rng, dtype, m, k, n):
  d = mesh.shape.get("d", 1)
  tp = mesh.shape["x"]
  lead = ("d",) if d > 1 else (None,)
  h = util.rand(rng, (d * tp * m, tp * k), dtype)
  w = util.rand(rng, (tp * k, n), dtype)
  return (jax.device_put(h, NamedSharding(mesh, P(*lead, "x"))),
          jax.device_put(w, NamedSharding(mesh, P("x"))), h, w)


@pytest.mark.parametrize("layout", ["4", "2x4"])
@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_push_matches_the_reference_call_after_call(layout, num_chunks, dtype):
  """Fresh random data on every call: the landing halves alternate, so a
  piece read from the wrong half, or before it landed, shows."""
  if util.on_gpu() and (layout != "4" or dtype != np.float32):
    pytest.skip("one GPU case per chunk count (bf16, tile-sized pieces)")
  mesh = _tp_mesh() if layout == "4" else util.mesh((2, 4), ("d", "x"))
  dtype, m, k, n = _shapes(dtype)
  f = _rs(mesh, num_chunks)
  rng = np.random.default_rng(7)
  args = _args(mesh, rng, dtype, m, k, n)
  hlo = f.lower(*args[:2]).compile().as_text()
  assert "ficco_push_finish" in hlo and "ficco_peer_copy" not in hlo
  assert "partition-id" not in hlo
  for _ in range(5):
    h, w, h_np, w_np = _args(mesh, rng, dtype, m, k, n)
    out = f(h, w)
    ref = util.ref_matmul_reduce_scatter(h_np, w_np)
    assert util.rel_err(out, ref) < util.tol(dtype)
  jax.block_until_ready(out)
  # The last finish's entry goes once its completion thread has run, which
  # may be just after the result is ready.
  assert util.window_entries_after(_platform()) == 0


def test_push_equals_the_rendezvous_path():
  """Same kernel, same pieces, same order of f32 adds, one rounding: the
  push protocol's sum and the rendezvous path's XLA sum agree exactly."""
  mesh = _tp_mesh()
  dtype, m, k, n = _shapes(jnp.bfloat16)
  rng = np.random.default_rng(3)
  h, w, _, _ = _args(mesh, rng, dtype, m, k, n)
  pushed = np.asarray(_rs(mesh, 3)(h, w), np.float32)
  pulled = np.asarray(_rs(mesh, 3, transport="rendezvous")(h, w), np.float32)
  np.testing.assert_array_equal(pushed, pulled)


def test_a_rank_that_never_arrives_fails_its_peers_then_caches_recover():
  mesh = _tp_mesh()
  last = mesh.devices.size - 1
  timeout_s = 1.0
  dtype, m, k, n = _shapes(np.float32)
  f = _rs(mesh, 1, timeout_s=timeout_s)
  h, w, h_np, w_np = _args(mesh, np.random.default_rng(5), dtype, m, k, n)
  ref = util.ref_matmul_reduce_scatter(h_np, w_np)
  jax.block_until_ready(f(h, w))
  platform = library.platform_id(_platform())
  missing = windows.handler_ordinal(mesh.devices.flat[last], platform)
  t0 = time.monotonic()
  with util.never_arriving(missing), pytest.raises(Exception) as info:
    jax.block_until_ready(f(h, w))
  assert time.monotonic() - t0 < timeout_s + 10
  message = str(info.value)
  # jax reports one device's error: the hooked device's own, or a peer's
  # timeout naming it.
  assert (f"rank {last}" in message
          or "never-arrive test hook" in message), message
  # The peers timed out, so their windows are poisoned: the next call says
  # how to recover...
  time.sleep(timeout_s + 1)
  with pytest.raises(Exception, match="clear_caches"):
    jax.block_until_ready(f(h, w))
  # ... and after it, fresh windows work.
  jax.clear_caches()
  assert util.rel_err(f(h, w), ref) < util.tol(dtype)


def _arm_windows(f, *args):
  """The window family of every push arm in ``f``'s lowered program."""
  text = f.lower(*args).as_text()
  return [int(w) for w in re.findall(
      r"@ficco_push_arm\(.*?window = (\d+) : i64", text)]


def test_programs_share_pooled_windows():
  """The k-th push site of every program shares the k-th pooled window: a
  second program over the same devices makes none, however many are
  lowered; a larger one grows the pool, and the program compiled against
  the outgrown window still runs on it."""
  mesh = _tp_mesh()
  dtype, m, k, n = _shapes(np.float32)
  platform = library.platform_id(_platform())
  rng = np.random.default_rng(11)
  # Four times the landing bytes: more than any window an earlier test left
  # in the pool (at most twice what it needed).
  big = _args(mesh, rng, dtype, m, k, 4 * n)
  small = _args(mesh, rng, dtype, m, k, n)
  f_small = _rs(mesh, 1)
  (w_small,) = _arm_windows(f_small, *small[:2])
  f_other = _rs(mesh, 3)  # another program, same slot or smaller
  assert _arm_windows(f_other, *small[:2]) == [w_small]
  f_big = _rs(mesh, 1, timeout_s=TIMEOUT_S + 1)  # another program
  (w_big,) = _arm_windows(f_big, *big[:2])
  assert w_big != w_small
  # Lowered after the pool grew, a small program shares the larger window
  # (its halves at the slot's midpoint, not at its own half size).
  f_late = _rs(mesh, 1, timeout_s=TIMEOUT_S + 2)
  assert _arm_windows(f_late, *small[:2]) == [w_big]
  count = windows.window_count(platform)
  # Every program's results, the outgrown window's included, over calls
  # that alternate between the windows and, on the shared one, between
  # programs of two sizes.
  for f, (h, w, h_np, w_np) in [(f_small, small), (f_big, big),
                                (f_late, small), (f_other, small),
                                (f_big, big), (f_late, small),
                                (f_small, small)]:
    ref = util.ref_matmul_reduce_scatter(h_np, w_np)
    assert util.rel_err(f(h, w), ref) < util.tol(dtype)
  assert windows.window_count(platform) == count


def _two_sites(mesh, timeout_s=TIMEOUT_S):
  """One program with two independent flagged reduce-scatters: two traces
  of the op in one body, so two sites (one traced function called twice
  would be one site, lowered once)."""
  op = _op(1, timeout_s)
  return jax.jit(jax.shard_map(
      lambda h, w, h2, w2: (op(h, w), op(h2, w2)), mesh=mesh,
      in_specs=(P(None, "x"), P("x")) * 2, out_specs=(P("x"), P("x")),
      check_vma=util.on_gpu()))


def test_one_program_gives_each_push_site_its_own_window():
  """Two independent reduce-scatters in one program may interleave their
  custom calls, so they must not share a window: distinct windows, and
  both results right over calls of fresh data."""
  mesh = _tp_mesh()
  dtype, m, k, n = _shapes(np.float32)
  two = _two_sites(mesh)
  rng = np.random.default_rng(13)
  a, b = _args(mesh, rng, dtype, m, k, n), _args(mesh, rng, dtype, m, k, n)
  first, second = _arm_windows(two, a[0], a[1], b[0], b[1])
  assert first != second
  for _ in range(3):
    a, b = _args(mesh, rng, dtype, m, k, n), _args(mesh, rng, dtype, m, k, n)
    out_a, out_b = two(a[0], a[1], b[0], b[1])
    assert util.rel_err(
        out_a, util.ref_matmul_reduce_scatter(a[2], a[3])) < util.tol(dtype)
    assert util.rel_err(
        out_b, util.ref_matmul_reduce_scatter(b[2], b[3])) < util.tol(dtype)


def test_one_clear_caches_recovers_a_failed_two_site_program():
  """A rank that never arrives fails the program at one site and may leave
  the other site's window with ranks at different epochs, unpoisoned: the
  next lowering must replace every pooled window of the group, so one
  jax.clear_caches() is enough."""
  mesh = _tp_mesh()
  last = mesh.devices.size - 1
  timeout_s = 1.0
  dtype, m, k, n = _shapes(np.float32)
  two = _two_sites(mesh, timeout_s=timeout_s)
  rng = np.random.default_rng(17)
  a, b = _args(mesh, rng, dtype, m, k, n), _args(mesh, rng, dtype, m, k, n)
  before = _arm_windows(two, a[0], a[1], b[0], b[1])
  jax.block_until_ready(two(a[0], a[1], b[0], b[1]))
  missing = windows.handler_ordinal(mesh.devices.flat[last],
                                    library.platform_id(_platform()))
  with util.never_arriving(missing), pytest.raises(Exception):
    jax.block_until_ready(two(a[0], a[1], b[0], b[1]))
  time.sleep(timeout_s + 1)  # Every peer's wait has timed out by now.
  jax.clear_caches()
  after = _arm_windows(two, a[0], a[1], b[0], b[1])
  assert not set(after) & set(before)
  out_a, out_b = two(a[0], a[1], b[0], b[1])
  assert util.rel_err(
      out_a, util.ref_matmul_reduce_scatter(a[2], a[3])) < util.tol(dtype)
  assert util.rel_err(
      out_b, util.ref_matmul_reduce_scatter(b[2], b[3])) < util.tol(dtype)
  # The failed execution's leftover arm entries went with its windows.
  jax.block_until_ready((out_a, out_b))
  assert util.window_entries_after(_platform()) == 0
