"""Long runs: host memory stays flat over many calls of the copy-engine ops.

Both ops on both transports of one process, interleaved, 100,000 calls on
the CPU twin (10,000 on GPUs, where a call takes longer): after a warm-up
the process's resident memory may not grow by more than 1 MiB, the
library's own entries drain to zero once the calls are done, and the last
results are still right. Each wait arms a deadline timer of ``timeout_s``
that must go when the wait completes, or every call's state would stay for
``timeout_s``.
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

WARMUP = 2000
MAX_GROWTH_MIB = 1.0


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
  transports = ("rendezvous", "window") if kind == "both" else (kind,)
  return [p for t in transports
          for p in (("ag", ag(f"direct/c2/dma/xla/{t}")),
                    ("rs", rs(f"direct/c1/dma/xla/{t}")))]


# "both" interleaves the two copy-engine transports; on GPUs each transport
# alone and XLA's own collectives also run, to tell whose any growth is.
@pytest.mark.parametrize("kind", [
    "both",
    pytest.param("rendezvous", marks=pytest.mark.gpu),
    pytest.param("window", marks=pytest.mark.gpu),
    pytest.param("xla", marks=pytest.mark.gpu),
])
def test_memory_is_flat_over_many_calls(kind):
  mesh = util.mesh((2,), ("x",))
  platform = mesh.devices.flat[0].platform
  calls = 100_000 if platform == "cpu" else 10_000
  rng = np.random.default_rng(0)
  x = util.rand(rng, (48, 40), np.float32)
  w = util.rand(rng, (40, 32), np.float32)
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

  run(WARMUP)
  before, device_before, heap_before = _rss_mib(), device_mib(), _heap_mib()
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
        f" {before:.1f} -> {middle:.1f} -> {before + growth:.1f} MiB, device"
        f" memory {device_growth:+.2f} MiB{heap}")
  assert growth <= MAX_GROWTH_MIB, (
      f"resident memory grew {growth:.2f} MiB over {calls} calls"
      f" ({1024 * growth / calls:.3f} KiB a call)")
  assert device_growth <= MAX_GROWTH_MIB, (
      f"device memory grew {device_growth:.2f} MiB over {calls} calls")
  ref = x.astype(np.float64) @ w.astype(np.float64)
  assert util.rel_err(out["ag"], ref) < util.tol(np.float32)
  assert util.rel_err(out["rs"], ref) < util.tol(np.float32)
  if platform == "cpu":
    # Rendezvous entries and deadline timers: none left once idle.
    assert util.library_entries_after("cpu") == 0
  assert util.window_entries_after(platform) == 0
