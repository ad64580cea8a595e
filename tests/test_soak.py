"""Long runs: host memory stays flat over many calls of the copy-engine ops.

Both ops on both transports of one process, interleaved, 100,000 calls on
the CPU twin (10,000 on GPUs, where each transport, the push path and
XLA's own collectives also run alone): after a warm-up the process's
resident memory may not grow by more than 1 MiB over those calls (in one of
up to three such windows: a leak grows in each), the library's own entries
drain to zero once the calls are done, and the last results are still
right. Each wait arms a deadline timer of ``timeout_s`` that must go when
the wait completes, or every call's state would stay for ``timeout_s``.
"""

import ctypes
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
import util

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]

MAX_GROWTH_MIB = 1.0
# On GPUs the process's footprint grows by about 5 MiB over the first
# ~30,000 calls after compiling, with XLA's own collectives as with ficco's:
# two threads' malloc arenas reach their size, while the bytes malloc has
# handed out stay flat (measured on 2xH200 over 100,000 calls of every kind
# here). A leak grows on; that settling does not, so the measured calls
# start after it.
WARMUP = {"cpu": 2000, "gpu": 30_000}
# Measured windows at most (each of the call count above).
MAX_WINDOWS = 3


def _rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
      "uordblks", "fordblks", "keepcost")]


def _heap_mib() -> float | None:
  """Bytes malloc has handed out and not taken back (glibc), in MiB: grows
  with a leak, not with fragmentation or memory mapped without malloc. On
  GPUs one block of ~1.85 MiB that XLA takes or gives back at times moves
  it by that much either way."""
  try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
  except (OSError, AttributeError):
    return None
  mallinfo2.restype = _Mallinfo2
  m = mallinfo2()
  return (m.uordblks + m.hblkhd) / 2**20


def _programs(mesh, kind):
  def ag(label):
    return jax.jit(jax.shard_map(
        functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                          schedule=Schedule.from_short(label)),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))

  def rs(label):
    return jax.jit(jax.shard_map(
        functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                          schedule=Schedule.from_short(label)),
        mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))

  if kind == "xla":  # XLA's collectives: jax's own growth, for reference.
    return [("ag", ag("direct/c2/xla")), ("rs", rs("direct/c1/xla"))]
  if kind == "push":  # The flagged reduce-scatter's pushes into windows.
    return [("rs", rs("direct/c1/dma/pallas/flagged"))]
  if kind == "push-ag":  # The push all-gather: one call per op.
    return [("ag", ag("direct/c1/dma/xla/flagged"))]
  transports = ("rendezvous", "window") if kind == "both" else (kind,)
  return [p for t in transports
          for p in (("ag", ag(f"direct/c2/dma/xla/{t}")),
                    ("rs", rs(f"direct/c1/dma/xla/{t}")))]


# "both" interleaves the two copy-engine transports; on GPUs each transport
# alone, the push path and XLA's own collectives also run, to tell whose any
# growth is. (The push path's Pallas kernel only interprets on CPU: too slow
# for a soak there.)
@pytest.mark.parametrize("kind", [
    "both",
    pytest.param("rendezvous", marks=pytest.mark.gpu),
    pytest.param("window", marks=pytest.mark.gpu),
    pytest.param("push", marks=pytest.mark.gpu),
    pytest.param("push-ag", marks=pytest.mark.gpu),
    pytest.param("xla", marks=pytest.mark.gpu),
])
def test_memory_is_flat_over_many_calls(kind):
  if kind != "both" and not util.on_gpu():
    # A one-GPU host: the test devices are CPUs, where the push path's
    # kernel only interprets.
    pytest.skip("soaks the GPU transports: needs 2 GPUs")
  mesh = util.mesh((2,), ("x",))
  platform = mesh.devices.flat[0].platform
  calls = 100_000 if platform == "cpu" else 10_000
  rng = np.random.default_rng(0)
  # The push path's kernel takes bf16 pieces of whole Hopper tiles.
  shape, dtype = (((1536, 512, 128), jnp.bfloat16) if kind == "push" else
                  ((48, 40, 32), np.float32))
  x = util.rand(rng, shape[:2], dtype)
  w = util.rand(rng, shape[1:], dtype)
  inputs = {
      "ag": (jax.device_put(x, NamedSharding(mesh, P("x"))),
             jax.device_put(w, NamedSharding(mesh, P(None, "x")))),
      "rs": (jax.device_put(x, NamedSharding(mesh, P(None, "x"))),
             jax.device_put(w, NamedSharding(mesh, P("x")))),
  }
  programs = _programs(mesh, kind)

  def run(n):
    out = {}
    for i in range(n):
      op, f = programs[i % len(programs)]
      out[op] = f(*inputs[op])
      # XLA:CPU stalls on deep queues of asynchronous calls.
      if i % 4 == 3:
        out[op].block_until_ready()
    jax.block_until_ready(out)
    return out

  def device_mib():
    stats = [d.memory_stats() or {} for d in mesh.devices.flat]
    return max(s.get("bytes_in_use", 0) for s in stats) / 2**20

  run(WARMUP[platform])
  # Windows of ``calls`` calls, until one leaves memory flat: a leak grows
  # in every window, where arenas still settling after the warm-up (seen
  # on a 4-GPU host, where the warm-up's 30,000 calls were not always
  # enough) grow in the first at most.
  for window in range(MAX_WINDOWS):
    before, device_before, heap_before = (_rss_mib(), device_mib(),
                                          _heap_mib())
    start = time.monotonic()
    run(calls // 2)
    # Half way: steady growth shows in both halves, a high-water mark in one.
    middle = _rss_mib()
    out = run(calls - calls // 2)
    elapsed = time.monotonic() - start
    growth = _rss_mib() - before
    device_growth = device_mib() - device_before
    heap = ("" if heap_before is None else
            f", malloc'd {_heap_mib() - heap_before:+.2f} MiB")
    print(f"{kind}: {calls} calls on {platform} in {elapsed:.1f} s: RSS"
          f" {before:.1f} -> {middle:.1f} -> {before + growth:.1f} MiB,"
          f" device memory {device_growth:+.2f} MiB{heap}"
          + (f" (window {window + 1})" if window else ""))
    if growth <= MAX_GROWTH_MIB and device_growth <= MAX_GROWTH_MIB:
      break
  assert growth <= MAX_GROWTH_MIB, (
      f"resident memory grew {growth:.2f} MiB over {calls} calls"
      f" ({1024 * growth / calls:.3f} KiB a call) in each of {MAX_WINDOWS}"
      " windows")
  assert device_growth <= MAX_GROWTH_MIB, (
      f"device memory grew {device_growth:.2f} MiB over {calls} calls"
      f" in each of {MAX_WINDOWS} windows")
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for op in out:
    assert util.rel_err(out[op], ref) < util.tol(dtype), op
  if platform == "cpu":
    # Rendezvous entries and deadline timers: none left once idle.
    assert util.library_entries_after("cpu") == 0
  assert util.window_entries_after(platform) == 0


def _shared_mapped_mib() -> float:
  """Bytes of ficco's POSIX shared memory mapped into this process (the CPU
  twin's windows, every window's host words), in MiB."""
  total = 0
  with open("/proc/self/maps") as f:
    for line in f:
      if "/ficco." in line:
        lo, hi = line.split()[0].split("-")
        total += int(hi, 16) - int(lo, 16)
  return total / 2**20


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_windows_are_flat_over_many_traces(platform):
  """Traces of one program after jax.clear_caches() share its windows:
  neither the window count nor the shared memory mapped grows with them
  (8 MiB shards on 4 devices: new windows would map 32 MiB a trace).
  Resident memory is printed, not checked: over the first traces it rises
  by a few times the gathered buffer and then steps up and down by one
  (malloc keeping freed 32 MiB buffers), with XLA's collectives as with
  ficco's, which would drown a small leak."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.dma import windows  # pylint: disable=g-import-not-at-top
  mesh = util.platform_mesh(platform, at_least=2)
  n = mesh.devices.size
  s = Schedule(dataflow="direct", comm="dma", transport="window")
  rng = np.random.default_rng(3)
  x = rng.standard_normal((n * 2048, 1024)).astype(np.float32)
  w = rng.standard_normal((1024, 8 * n)).astype(np.float32)
  args = (jax.device_put(x, NamedSharding(mesh, P("x"))),
          jax.device_put(w, NamedSharding(mesh, P(None, "x"))))
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

  def trace_and_call():
    jax.clear_caches()
    f = jax.jit(jax.shard_map(
        functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                          schedule=s),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
    return f(*args).block_until_ready()

  trace_and_call()
  pid = library.platform_id(platform)
  count, shared, rss = windows.window_count(pid), _shared_mapped_mib(), _rss_mib()
  traces = 10
  for _ in range(traces):
    out = trace_and_call()
  print(f"{platform}: {traces} traces: windows {count} ->"
        f" {windows.window_count(pid)}, shared memory {shared:.1f} ->"
        f" {_shared_mapped_mib():.1f} MiB, RSS {rss:.0f} -> {_rss_mib():.0f}"
        " MiB")
  assert windows.window_count(pid) == count
  assert _shared_mapped_mib() == shared
  assert util.rel_err(out, ref) < util.tol(np.float32)
