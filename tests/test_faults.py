"""Fault injection: a rank that fails at any protocol step.

The library's fault hook makes one device's handlers of one protocol step
fail at once, as a rank that raises there would: the start (rendezvous and
window start, push arm, push all-gather), the wait (the rendezvous sync
that waits for landing buffers, window wait, push start, push all-gather
once its pushes are queued) or the done (the rendezvous sync that ends
invocations, window done, push finish), or, for the window and push
transports, the window's issue lock found held by another host thread past
the op's timeout ("held"). Whatever the step, the call must
end within the op's ``timeout_s`` (plus slack) with an error that names
the failing rank or the hook, never hang; the library must keep nothing
registered for it; and the program must work again afterwards, at most
after the one ``jax.clear_caches()`` that a poisoned window asks for.
"""

import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.dma import library
from ficco_jax._src.dma import windows
import util

pytestmark = pytest.mark.multigpu

TIMEOUT_S = 1.0

# transport -> (op, schedule label, the steps it has)
CASES = {
    "rendezvous": ("ag", "direct/c2/dma/xla/rendezvous",
                   ("start", "wait", "done")),
    "window": ("ag", "direct/c2/dma/xla/window",
               ("start", "wait", "done", "held")),
    "push": ("rs", "direct/c1/dma/pallas/flagged/push",
             ("start", "wait", "done", "held")),
    # The push all-gather is one call: at "start" its rank never arrives;
    # at "wait" it fails once its pushes are queued, which it drains.
    "push-ag": ("ag", "direct/c1/dma/xla/flagged/push",
                ("start", "wait", "held")),
    # The signalled all-gather: its kernel waits on landing flags, which a
    # failed invocation must still set.
    "signalled-ag": ("ag", "direct/c2/dma/pallas/flagged/window",
                     ("start", "wait", "done", "held")),
}


def _program(mesh, op, label):
  schedule = Schedule.from_short(label)
  if op == "ag":
    return jax.jit(jax.shard_map(
        functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                          schedule=schedule, timeout_s=TIMEOUT_S),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"),
        # Pallas's CPU interpreter does not type varying axes.
        check_vma=util.on_gpu() or schedule.compute != "pallas"))
  return jax.jit(jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                        schedule=schedule, timeout_s=TIMEOUT_S),
      mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"),
      check_vma=util.on_gpu()))


def _last_rank(mesh):
  """The mesh's last rank, which the tests make fail, and the ordinal its
  handlers see (what the fault hook takes)."""
  last = mesh.devices.size - 1
  pid = library.platform_id(util.platform_name())
  return last, windows.handler_ordinal(mesh.devices.flat[last], pid)


def _inputs(mesh, op, rng):
  p = mesh.devices.size
  if util.on_gpu():  # Whole Hopper tiles for the flagged kernels.
    dtype, m, k, n = jnp.bfloat16, 768 * p, 256 * p, 128 * p
  else:
    dtype, m, k, n = np.float32, 6 * p, 10 * p, 7 * p
  x = util.rand(rng, (m, k), dtype)
  w = util.rand(rng, (k, n), dtype)
  specs = ((P("x"), P(None, "x")) if op == "ag" else (P(None, "x"), P("x")))
  args = tuple(jax.device_put(a, NamedSharding(mesh, s))
               for a, s in zip((x, w), specs))
  return args, util.ref_all_gather_matmul(x, w), dtype


@pytest.mark.parametrize("transport,step", [
    (t, s) for t, (_, _, steps) in CASES.items() for s in steps])
def test_a_rank_that_fails_at_a_step_ends_the_call_and_the_next_works(
    transport, step):
  op, label, _ = CASES[transport]
  mesh = util.tp_mesh()
  last, ordinal = _last_rank(mesh)
  f = _program(mesh, op, label)
  args, ref, dtype = _inputs(mesh, op, np.random.default_rng(3))
  assert util.rel_err(f(*args), ref) < util.tol(dtype)
  platform = util.platform_name()

  t0 = time.monotonic()
  with util.failing_at(ordinal, step), pytest.raises(Exception) as info:
    jax.block_until_ready(f(*args))
  assert time.monotonic() - t0 < TIMEOUT_S + 20
  message = str(info.value)
  # jax reports one device's error: the failing device's own, or a peer's
  # timeout naming the failing rank.
  assert "test hook" in message or f"rank {last}" in message, message
  if platform == "cpu":
    # The failed execution's registrations go with it, before any later
    # call could sweep them.
    assert util.library_entries_after("cpu") == 0
    assert util.live_invocations_after("cpu") == 0

  # Every peer has given up by now; then the program works again, after
  # the jax.clear_caches() a poisoned window asks for, if it does.
  time.sleep(TIMEOUT_S + 1)
  try:
    out = f(*args)
    jax.block_until_ready(out)
  except Exception as e:  # pylint: disable=broad-except
    assert "clear_caches" in str(e), str(e)
    jax.clear_caches()
    f = _program(mesh, op, label)
    out = f(*args)
  assert util.rel_err(out, ref) < util.tol(dtype)
  assert util.window_entries_after(platform) == 0
  if platform == "cpu":
    assert util.library_entries_after("cpu") == 0


@pytest.mark.parametrize("transport,calls", [("rendezvous", 30),
                                             ("window", 12)])
def test_failed_syncs_leave_no_copy_behind(transport, calls):
  """A sync that fails while its execution's copies still run: before the
  error surfaces (and XLA frees the buffers), the copies into and out of
  that device's buffers end, so none lands in memory that a later call
  owns (on the CPU twin: heap corruption, or a wrong result). A failed
  window call poisons its window: the program is lowered afresh after
  each, as its error says."""
  op, label, _ = CASES[transport]
  mesh = util.tp_mesh()
  last, ordinal = _last_rank(mesh)
  f = _program(mesh, op, label)
  rng = np.random.default_rng(5)
  platform = util.platform_name()
  for i in range(calls):
    args, _, _ = _inputs(mesh, op, rng)
    with util.failing_at(ordinal, ("wait", "done")[i % 2]):
      with pytest.raises(Exception) as info:
        jax.block_until_ready(f(*args))
    message = str(info.value)
    assert "test hook" in message or f"rank {last}" in message, message
    if transport == "window":
      time.sleep(TIMEOUT_S + 0.5)  # Every peer has given up.
      jax.clear_caches()
      f = _program(mesh, op, label)
    args, ref, dtype = _inputs(mesh, op, rng)
    assert util.rel_err(f(*args), ref) < util.tol(dtype), i
  if platform == "cpu":
    assert util.library_entries_after("cpu") == 0
    assert util.live_invocations_after("cpu") == 0
  assert util.window_entries_after(platform) == 0


def test_fault_steps_are_checked():
  with pytest.raises(ValueError, match="step='finish' must be one of"):
    library.set_fault(0, "finish")


def test_a_retry_loop_gets_through_after_a_stall():
  """Ranks that never start the op (a lax.cond skips it there) stall a
  rendezvous, and the devices then refuse the calls queued behind it, each
  refusal extending the refusal. A caller that catches the error and
  retries at once, again and again, still gets through: the refusals end
  a few seconds after the stall (stall_breaker.h's kMaxRefusing), however
  often it tries."""
  mesh = util.tp_mesh()
  p = mesh.devices.size
  schedule = Schedule.from_short("direct/c1/dma/xla/rendezvous")
  rng = np.random.default_rng(40)
  args, ref, dtype = _inputs(mesh, "ag", rng)

  def stalled(x, w):  # Only rank 0 takes part.
    return jax.lax.cond(
        jax.lax.axis_index("x") == 0,
        lambda x: ficco_jax.all_gather_matmul(x, w, axis_name="x",
                                              schedule=schedule,
                                              timeout_s=TIMEOUT_S),
        lambda x: jnp.zeros((x.shape[0] * p, w.shape[1]), x.dtype), x)
  f = jax.jit(jax.shard_map(stalled, mesh=mesh, in_specs=(P("x"), P(None, "x")),
                            out_specs=P(None, "x"), check_vma=False))
  # Compiled before the stall, so that the first retry comes at once.
  good = _program(mesh, "ag", schedule.short()).lower(*args).compile()
  with pytest.raises(Exception, match="never"):
    jax.block_until_ready(f(*args))
  failed = time.monotonic()
  refused = 0
  while True:
    try:
      out = jax.block_until_ready(good(*args))
      break
    except Exception as e:  # pylint: disable=broad-except
      assert "not started" in str(e), str(e)
      refused += 1
      assert time.monotonic() - failed < 10.0, (refused, str(e))
      time.sleep(0.05)
  took = time.monotonic() - failed
  assert refused >= 1, "the retries were never refused: nothing was tested"
  assert util.rel_err(out, ref) < util.tol(dtype)
  print(f"through after {took:.2f} s, {refused} refused")


@pytest.mark.parametrize("transport", ["window", "push"])
def test_recovering_from_failures_frees_the_poisoned_windows(transport):
  """A loop that recovers from failures by lowering again holds at most the
  windows of its last failure: lowering retires a poisoned family and frees
  it once its calls have ended. A program still compiled against a freed
  family (ahead of time, here) fails at once, saying to lower again and
  what the first failure was."""
  op, label, _ = CASES[transport]
  mesh = util.tp_mesh()
  last, ordinal = _last_rank(mesh)
  platform = util.platform_name()
  pid = library.platform_id(platform)
  rng = np.random.default_rng(11)
  args, ref, dtype = _inputs(mesh, op, rng)
  f = _program(mesh, op, label)
  compiled = f.lower(*args).compile()
  assert util.rel_err(compiled(*args), ref) < util.tol(dtype)
  counts = []
  for i in range(6):
    with util.failing_at(ordinal, ("wait", "done")[i % 2]):
      with pytest.raises(Exception) as info:
        jax.block_until_ready(f(*args))
    assert "test hook" in str(info.value) or f"rank {last}" in str(
        info.value), str(info.value)
    time.sleep(TIMEOUT_S + 0.5)  # Every peer has given up.
    jax.clear_caches()
    f = _program(mesh, op, label)
    assert util.rel_err(f(*args), ref) < util.tol(dtype), i
    counts.append(windows.window_count(pid))
  # Before, each failure kept its family: the count grew by a family a
  # failure. Now at most one retired family (a device's windows) is still
  # held when the next is made, and goes at the next lowering.
  assert max(counts[1:]) <= counts[0] + mesh.devices.size, counts
  with pytest.raises(Exception) as info:
    jax.block_until_ready(compiled(*args))
  message = str(info.value)
  # The first failure: the hook's, or on a loaded machine a peer's timeout
  # that came first (naming the rank it waited for).
  assert "lower" in message and ("test hook" in message or
                                  "never signalled: rank" in message), message
  assert util.window_entries_after(platform) == 0


def test_a_failure_to_make_the_new_windows_is_retried(monkeypatch):
  """Lowering after a failure retires the poisoned family before it makes
  the new one; if making it fails (shared memory full, cudaMalloc out of
  memory, a peer process that never publishes), the next lowering tries
  again instead of reusing the retired family for good."""
  op, label, _ = CASES["window"]
  mesh = util.tp_mesh()
  _, ordinal = _last_rank(mesh)
  args, ref, dtype = _inputs(mesh, op, np.random.default_rng(1))
  f = _program(mesh, op, label)
  assert util.rel_err(f(*args), ref) < util.tol(dtype)
  with util.failing_at(ordinal, "wait"), pytest.raises(Exception):
    jax.block_until_ready(f(*args))
  time.sleep(TIMEOUT_S + 0.5)  # Every peer has given up.
  real, calls = windows._create_and_map, []  # pylint: disable=protected-access

  def fails_once(*a, **kw):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("ficco window: no memory (injected)")
    return real(*a, **kw)

  monkeypatch.setattr(windows, "_create_and_map", fails_once)
  jax.clear_caches()
  with pytest.raises(Exception, match="injected"):
    _program(mesh, op, label)(*args)
  jax.clear_caches()
  assert util.rel_err(_program(mesh, op, label)(*args), ref) < util.tol(dtype)
  assert len(calls) == 2


def test_a_push_pool_of_two_slot_sizes_recovers_without_growing():
  """The push reduce-scatter and all-gather share the pooled push windows
  with different slots, so each lowering leaves the smaller family
  outgrown; a failure on either replaces the whole pool, outgrown families
  included, so a recover loop holds at most its last failure's windows."""
  mesh = util.tp_mesh()
  _, ordinal = _last_rank(mesh)
  platform = util.platform_name()
  pid = library.platform_id(platform)
  rng = np.random.default_rng(13)
  cases = [(op, _inputs(mesh, op, rng)) for op in ("rs", "ag")]
  labels = {"rs": CASES["push"][1], "ag": CASES["push-ag"][1]}
  counts = []
  for i in range(6):
    programs = [_program(mesh, op, labels[op]) for op, _ in cases]
    for f, (_, (args, ref, dtype)) in zip(programs, cases):
      assert util.rel_err(f(*args), ref) < util.tol(dtype), i
    counts.append(windows.window_count(pid))
    f, (_, (args, _, _)) = programs[i % 2], cases[i % 2]
    with util.failing_at(ordinal, "wait"), pytest.raises(Exception):
      jax.block_until_ready(f(*args))
    time.sleep(TIMEOUT_S + 0.5)  # Every peer has given up.
    jax.clear_caches()
  # At most one retired family still held (a window per device); before,
  # each failure kept two.
  assert max(counts[1:]) <= counts[0] + mesh.devices.size, counts
  assert util.window_entries_after(platform) == 0


def test_windows_half_made_are_freed(monkeypatch):
  """A lowering that fails while making its windows (a peer's window that
  cannot be mapped) frees those it made, names and all, so retrying does
  not grow."""
  mesh = util.tp_mesh()
  pid = library.platform_id(util.platform_name())
  args, ref, dtype = _inputs(mesh, "ag", np.random.default_rng(17))

  def half_made():  # A name of its own: no earlier program's windows.
    def windows_half_made(x, w):
      return ficco_jax.all_gather_matmul(
          x, w, axis_name="x", timeout_s=TIMEOUT_S,
          schedule=Schedule.from_short("direct/c1/dma/xla/window"))
    return jax.jit(jax.shard_map(
        windows_half_made, mesh=mesh, in_specs=(P("x"), P(None, "x")),
        out_specs=P(None, "x")))
  lib = windows._lib()  # pylint: disable=protected-access
  real_map, maps = lib.FiccoWindowMap, []

  def fails_third(*a):
    maps.append(1)
    if len(maps) == 3:
      raise RuntimeError("ficco window: mmap failed (injected)")
    return real_map(*a)

  before = windows.window_count(pid)
  shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
  monkeypatch.setattr(lib, "FiccoWindowMap", fails_third)
  for _ in range(3):
    maps.clear()
    jax.clear_caches()
    with pytest.raises(RuntimeError, match="injected"):
      half_made()(*args)
    assert windows.window_count(pid) == before
  if shm:
    left = {n for n in set(os.listdir("/dev/shm")) - shm if "ficco" in n}
    assert not left, left
  monkeypatch.undo()
  jax.clear_caches()
  assert util.rel_err(half_made()(*args), ref) < util.tol(dtype)


def test_a_window_exchange_that_times_out_says_what_to_do(monkeypatch):
  """Across processes, a lowering whose peer never publishes its window
  (it did not lower again after a failure) fails naming the window, the
  peer's process and what every process must do, not with the key-value
  store's bare timeout."""

  class Client:

    def blocking_key_value_get(self, key, timeout_ms):
      raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with"
                         f" key: {key} and duration: {timeout_ms} ms")

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(windows._Directory, "_client",  # pylint: disable=protected-access
                      staticmethod(Client))
  with pytest.raises(RuntimeError) as info:
    windows._directory.get(  # pylint: disable=protected-access
        "ficco/window/0-1/2/1", 3.0, "the window of rank 1 (device 1,"
        " process 1)")
  message = str(info.value)
  for part in ("rank 1 (device 1, process 1)", "within 3 s",
               "every process must lower again",
               "pairs it with the others once they do", "DEADLINE_EXCEEDED"):
    assert part in message, message


def test_a_window_exchange_waits_out_a_stale_value(monkeypatch):
  """A peer's key may still hold its failed attempt's value (withdrawn, or
  another attempt's nonces): the exchange waits until the peer replaces
  it, fails by the timeout if it never does, and fails at once if the
  value is wrong rather than late (``match`` raises)."""
  store = {"k": "old"}

  class Client:

    def blocking_key_value_get(self, key, timeout_ms):
      del timeout_ms
      return store[key]

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(windows._Directory, "_client",  # pylint: disable=protected-access
                      staticmethod(Client))
  directory = windows._directory  # pylint: disable=protected-access
  timer = threading.Timer(0.3, lambda: store.update(k="new"))
  timer.start()
  start = time.monotonic()
  assert directory.get("k", 5.0, "the key", lambda v: v == "new") == "new"
  assert 0.25 < time.monotonic() - start < 4.0
  timer.join()
  start = time.monotonic()
  with pytest.raises(RuntimeError, match="the key did not come within"):
    directory.get("k", 0.5, "the key", lambda v: v == "newer")
  assert time.monotonic() - start < 3.0

  def wrong(value):
    raise ValueError(f"a window of another kind: {value}")

  with pytest.raises(ValueError, match="another kind: new"):
    directory.get("k", 5.0, "the key", wrong)
