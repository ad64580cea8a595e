"""The window transport (docs/windows.md) in one process.

``Schedule(transport="window")`` makes comm="dma" stage through symmetric
windows and synchronise by flags, as it must across processes (tests/
test_multiprocess.py); here it runs between the virtual CPU devices of one
process (the CPU twin) and between GPUs. test_ops.py checks its results
for every dataflow; these tests check what is particular to it.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.dma import library
from ficco_jax._src.dma import windows

import util

TIMEOUT_S = 30.0

pytestmark = pytest.mark.multigpu


@pytest.fixture(params=["cpu", "cuda"])
def platform(request):
  return request.param


_mesh = util.platform_mesh


def _ag(mesh, schedule, timeout_s=TIMEOUT_S):
  return jax.jit(jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                        schedule=schedule, timeout_s=timeout_s),
      mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))


def _put(mesh, spec, a):
  return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))


def _tol(platform, dtype):
  if platform == "cpu" and np.dtype(dtype) == np.float32:
    return 1e-5
  return util.tol(dtype) if platform == "cpu" else max(util.tol(dtype), 3e-3)


def test_lowering_uses_window_targets_and_no_forwarding(platform):
  mesh = _mesh(platform)
  f = _ag(mesh, Schedule(dataflow="ring", num_chunks=2, comm="dma",
                         transport="window"))
  x = jax.ShapeDtypeStruct((24, 10), np.float32,
                           sharding=jax.sharding.NamedSharding(mesh, P("x")))
  w = jax.ShapeDtypeStruct((10, 28), np.float32,
                           sharding=jax.sharding.NamedSharding(mesh, P(None, "x")))
  text = f.lower(x, w).as_text()
  assert text.count("ficco_window_start") == 1
  assert text.count("ficco_window_wait") == 6  # (P - 1) * num_chunks
  assert "ficco_peer_copy" not in text
  # Ring forwarding becomes pulls from the owner: every src is operand 0.
  assert "src = dense<0> : tensor<6xi64>" in text


def test_scan_runs_one_site_many_times_and_leaves_nothing_pending(platform):
  mesh = _mesh(platform)
  s = Schedule(dataflow="ring", num_chunks=1, comm="dma", transport="window")
  rng = np.random.default_rng(1)
  ws = rng.standard_normal((5, 8, 8 * 4)).astype(np.float32) / 3

  def body(x, w):
    y = ficco_jax.all_gather_matmul(x, w, axis_name="x", schedule=s)
    # [32, 8] per device -> back to this rank's [8, 8] rows.
    r = lax.axis_index("x")
    y = lax.dynamic_slice_in_dim(y, r * 8, 8)
    return jnp.tanh(y), None

  def scan_one_site(x, ws):
    # Named: programs of one name and slot share windows, and this test
    # counts the ones it makes.
    return lax.scan(body, x, ws)[0]

  f = jax.jit(jax.shard_map(
      scan_one_site, mesh=mesh,
      in_specs=(P("x"), P(None, None, "x")), out_specs=P("x")))
  x = rng.standard_normal((32, 8)).astype(np.float32)
  before = windows.window_count(library.platform_id(platform))
  out = f(_put(mesh, P("x"), x), _put(mesh, P(None, None, "x"), ws))
  ref = np.asarray(x, np.float64)
  for w in ws:
    full = ref @ np.asarray(w, np.float64)
    ref = np.tanh(np.concatenate(
        [full[r * 8:(r + 1) * 8, r * 8:(r + 1) * 8] for r in range(4)]))
  assert util.rel_err(out, ref) < _tol(platform, np.float32)
  made = windows.window_count(library.platform_id(platform)) - before
  assert made == 4  # One site, one window per device.
  for _ in range(50):
    out = f(_put(mesh, P("x"), x), _put(mesh, P(None, None, "x"), ws))
  out.block_until_ready()
  assert windows.window_count(library.platform_id(platform)) - before == 4
  assert util.window_entries_after(platform) == 0


def test_retracing_a_program_maps_no_new_windows(platform):
  """Traces of one program (after jax.clear_caches(), under new jax.jit
  wrappers) share its windows, and two live traces called alternately,
  unblocked, from one thread stay right (one window, one program at a time
  on each device)."""
  mesh = _mesh(platform, at_least=2)
  s = Schedule(dataflow="ring", num_chunks=2, comm="dma", transport="window")
  rng = np.random.default_rng(5)
  xs = [rng.standard_normal((24, 10)).astype(np.float32) for _ in range(2)]
  w_np = rng.standard_normal((10, 28)).astype(np.float32)
  refs = [np.asarray(x, np.float64) @ np.asarray(w_np, np.float64)
          for x in xs]
  args = [(_put(mesh, P("x"), x), _put(mesh, P(None, "x"), w_np))
          for x in xs]
  pid = library.platform_id(platform)
  assert util.rel_err(_ag(mesh, s)(*args[0]), refs[0]) < _tol(
      platform, np.float32)
  count = windows.window_count(pid)
  for _ in range(3):
    jax.clear_caches()
    assert util.rel_err(_ag(mesh, s)(*args[1]), refs[1]) < _tol(
        platform, np.float32)
  f, g = _ag(mesh, s), _ag(mesh, s)
  outs = [(h(*args[i % 2]), i % 2)
          for i, h in enumerate([f, g] * 10)]
  for out, i in outs:
    assert util.rel_err(out, refs[i]) < _tol(platform, np.float32)
  assert windows.window_count(pid) == count
  assert util.window_entries_after(platform) == 0


def test_a_rank_that_never_arrives_fails_its_peers_then_caches_recover(
    platform):
  mesh = _mesh(platform, at_least=2)
  last = mesh.devices.size - 1
  timeout_s = 1.0
  f = _ag(mesh, Schedule(dataflow="direct", comm="dma", transport="window"),
          timeout_s=timeout_s)
  rng = np.random.default_rng(2)
  x = _put(mesh, P("x"), rng.standard_normal((24, 10)).astype(np.float32))
  w = _put(mesh, P(None, "x"), rng.standard_normal((10, 28)).astype(np.float32))
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  f(x, w).block_until_ready()
  missing = windows.handler_ordinal(mesh.devices.flat[last],
                                    library.platform_id(platform))
  t0 = time.monotonic()
  with util.never_arriving(missing), pytest.raises(Exception) as info:
    f(x, w).block_until_ready()
  assert time.monotonic() - t0 < timeout_s + 10
  message = str(info.value)
  # jax reports one device's error: the hooked device's own, or a peer's
  # timeout naming it.
  assert (f"rank {last}" in message or "never-arrive test hook" in message), (
      message)
  # The peers timed out (on CUDA their watchdog fires after the deadline),
  # so the window is poisoned: the next call says how to recover...
  time.sleep(timeout_s + 1)
  with pytest.raises(Exception, match="clear_caches"):
    f(x, w).block_until_ready()
  # ... and after it, fresh windows work.
  jax.clear_caches()
  assert util.rel_err(f(x, w), ref) < _tol(platform, np.float32)
  # The failed execution's waits and dones, which never ran, are not kept.
  assert util.window_entries_after(platform) == 0


class _Dev:
  def __init__(self, i, process):
    self.id, self.process_index, self.local_hardware_id = i, process, i


class _Mesh:
  def __init__(self, processes):
    self.devices = np.asarray([_Dev(i, p) for i, p in enumerate(processes)],
                              dtype=object)
    self.axis_names = ("x",)


def test_transport_choice():
  """Automatic: the window transport exactly when the axis spans processes,
  which the rendezvous transport cannot reach."""
  here = jax.process_index()
  local, split = _Mesh([here] * 4), _Mesh([here, here, here + 1, here + 1])
  assert not windows.spans_processes(local, "x")
  assert windows.spans_processes(split, "x")
  auto = Schedule(dataflow="ring", comm="dma")
  assert auto.resolved_transport(spans_processes=False) == "rendezvous"
  assert auto.resolved_transport(spans_processes=True) == "window"
  pinned = dataclasses.replace(auto, transport="rendezvous")
  with pytest.raises(ValueError, match="spans processes.*comm='xla'"):
    pinned.resolved_transport(spans_processes=True)
