"""A process of a multi-process test, started by ficco_jax.launch.

  mode "ops":   both ops with comm="xla" over an axis that spans every
                process, checked against a float64 reference.
  mode "dma":   both ops with comm="dma" over such an axis (the window
                transport: windows exchanged through the distributed
                key-value store), every dataflow, checked the same way; and
                a dp x tp mesh whose tp groups span processes.
  mode "push":  the flagged reduce-scatter and the push all-gather over
                such an axis (a job of several processes pushes:
                docs/windows.md, "Push"), and the signalled all-gather
                (window transport, landing flags).
  mode "moe":   an expert-parallel MoE layer (all_to_all_matmul, relu,
                matmul_all_to_all) over such an axis, the rows on the copy
                engines (window transport), skewed routing, against a
                float64 per-token reference; on GPUs the experts on the
                grouped kernel.
  mode "otherhost": as if each process ran on a host of its own
                (`windows.hostname` replaced): comm="dma" must be refused,
                naming
                comm='xla'.
  mode "stall": process 1 lowers and runs once, then stops taking part
                (it sleeps); process 0's next calls must fail with a
                timeout that names the missing rank, within bounds.
  mode "die":   process 1 exits at once; the others block in a collective
                (the launcher must stop them).
  mode "raise": process 1 raises after a first collective; the others block
                in the next one (the job must end at once, naming process 1).
  mode "sleep": every process writes its pid to $FICCO_TEST_PID_DIR, ignores
                SIGTERM and sleeps (the launcher, interrupted, must still
                leave none behind).
  mode "loop":  every process runs comm="dma" all-gather matmuls (the window
                transport) until it is stopped, after writing its pid to
                $FICCO_TEST_PID_DIR/<process index> (the test kills one).
  mode "hang":  process 1 runs one call, writes the time to
                $FICCO_TEST_STALL_FILE and sleeps for good; process 0's next
                call must raise its timeout error (uncaught: the job fails).
                The window all-gather, or with $FICCO_TEST_SCHEDULE=signalled
                the signalled one (its kernel waiting on landing flags).
  mode "alternate": an all-gather matmul and a reduce-scatter matmul, both
                comm="dma", alternate for $FICCO_TEST_CALLS calls on inputs
                that change every call, each result checked; the window
                transport's, or with $FICCO_TEST_SCHEDULE=flagged the
                signalled all-gather and the pushing flagged reduce-scatter.
  mode "twice": one traced site run several times at once in one
                execution (a jitted layer called 4 times; its recomputation
                under jax.grad of jax.checkpoint), window transport, every
                result checked (GPUs only: their devices run a program in
                one order, so the ranks pair the calls by epoch).
  mode "threads": in every process, two host threads dispatch those two
                programs concurrently (unsupported: docs/protocol.md,
                "Several dispatching threads"); every call must end, right
                or with an error that says what to do, and the programs,
                lowered afresh, must work from one thread afterwards. The
                window transport's, or with $FICCO_TEST_SCHEDULE=push the
                push all-gather and the flagged reduce-scatter, which
                share one pooled push window, or with =same one window
                all-gather program from both threads. $FICCO_TEST_ROUNDS
                times (default 1), each on programs lowered afresh.
  mode "recover": process 1's window start, then its wait, fails (the
                fault hook) in 4 calls of the window all-gather; its call
                must fail (a failed start fails every process's: their
                starts wait for it; after a failed wait the others' may
                succeed); then every process lowers afresh and must be right
                again (a process that succeeded must take the others'
                failure for its own, or lowering would pair different
                windows), and the failed families' windows must be freed
                (CUDA: but for device memory the other process maps, which
                stays).
  mode "alone": process 1's start fails, failing both processes' calls;
                then process 1 alone lowers again twice, each time waiting
                out a short exchange timeout (process 0 does not lower);
                then both lower again and must pair and be right (a failed
                exchange does not count a generation).
  mode "shapes": the processes lower one program with different shapes
                (slots of different sizes): both must fail naming the
                other's window, not pair them; then, lowering the same
                shapes (process 1 later), they must pair and be right.
  mode "late":  process 1's exchange fails (as if by its timeout) just
                after process 0 mapped its windows; its second lowering must
                pair with process 0's first (which maps process 1's new
                windows instead of waiting out its timeout), and be right.
  mode "mismatch": each process runs a program of its own (same op, same
                shapes, another name) on the pooled push window, so the
                ranks pair two programs at one epoch: every process must
                fail naming the cause (push_ident.h).

"""

import os
import sys
import time

from ficco_jax import launch

launch.initialize_from_env()

import dataclasses  # pylint: disable=g-import-not-at-top,g-bad-import-order
import functools  # pylint: disable=g-import-not-at-top,g-bad-import-order

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.dma import windows
import util


def _global(mesh, spec, a):
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                      lambda idx: a[idx])


def _check(out, ref, tol=1e-5):
  for shard in out.addressable_shards:
    got = np.asarray(shard.data, np.float64)
    want = ref[shard.index]
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, err


def _program(op, mesh, a_spec, w_spec, out_spec, schedule, check_vma=True,
             **kw):
  # check_vma=False for Pallas kernels on CPU: the interpreter does not type
  # varying axes.
  return jax.jit(jax.shard_map(
      functools.partial(op, axis_name="x", schedule=schedule, **kw),
      mesh=mesh, in_specs=(a_spec, w_spec), out_specs=out_spec,
      check_vma=check_vma))


def _run(op, mesh, a, w, a_spec, w_spec, out_spec, schedule):
  f = _program(op, mesh, a_spec, w_spec, out_spec, schedule)
  return f(_global(mesh, a_spec, a), _global(mesh, w_spec, w))


def _dma_all_gather(mesh, x, w, timeout_s):
  """A comm="dma" all-gather matmul program and its arguments."""
  f = _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
               P(None, "x"), Schedule(dataflow="direct", comm="dma"),
               timeout_s=timeout_s)
  return f, (_global(mesh, P("x"), x), _global(mesh, P(None, "x"), w))


# Pallas compute, flagged granularity: the signalled all-gather (window
# transport, landing flags; on GPUs its kernel waits on them) and the
# pushing reduce-scatter.
FLAGGED = Schedule(dataflow="direct", comm="dma", compute="pallas",
                   compute_granularity="flagged")
# The push all-gather (docs/windows.md, "Push all-gather").
PUSH_GATHER = Schedule(dataflow="direct", num_chunks=1, comm="dma",
                       compute="xla", compute_granularity="flagged")


def _pallas_case():
  """(GPU?, per-device m, k, n, dtype, tolerance) of the Pallas-compute
  cases: on GPUs bf16 pieces of whole Hopper tiles (768 rows per device,
  up to 3 chunks), elsewhere small f32 for the interpreter."""
  if jax.default_backend() == "gpu":
    return True, 768, 256, 128, jnp.bfloat16, 2e-2
  return False, 6, 4, 5, np.float32, 1e-5


def _signalled_all_gather(mesh, rng, timeout_s):
  """A signalled all-gather matmul program and its arguments."""
  gpu, m, k, n, dtype, _ = _pallas_case()
  p = mesh.size
  f = _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
               P(None, "x"), FLAGGED, check_vma=gpu, timeout_s=timeout_s)
  x = rng.standard_normal((m * p, k)).astype(dtype)
  w = rng.standard_normal((k, n * p)).astype(dtype)
  return f, (_global(mesh, P("x"), x), _global(mesh, P(None, "x"), w))


# What a call dispatched from two threads may fail with: the timeout that
# names the ranks that never signalled, the poisoned window's advice, or the
# advice to dispatch from one thread.
CLEAR = ("never signalled", "clear_caches", "dispatch them from one thread")


def _twice(mesh, rng) -> int:
  """The "twice" mode (docs/protocol.md, "Several runs of one site")."""
  p, calls = mesh.size, 4
  layer = jax.jit(functools.partial(
      ficco_jax.all_gather_matmul, axis_name="x",
      schedule=Schedule(dataflow="direct", num_chunks=2, comm="dma",
                        transport="window")))
  xs = [rng.standard_normal((6 * p, 10)).astype(np.float32)
        for _ in range(calls)]
  w = rng.standard_normal((10, 3 * p)).astype(np.float32)
  f = jax.jit(jax.shard_map(
      lambda xs, w: [layer(x, w) for x in xs], mesh=mesh,
      in_specs=([P("x")] * calls, P(None, "x")),
      out_specs=[P(None, "x")] * calls))

  def loss(x, w):
    y = jax.shard_map(jax.checkpoint(layer), mesh=mesh,
                      in_specs=(P("x"), P(None, "x")),
                      out_specs=P(None, "x"))(x, w)
    return jnp.sum(jnp.sin(y))

  g = jax.jit(jax.grad(loss, argnums=(0, 1)))
  args = ([_global(mesh, P("x"), x) for x in xs], _global(mesh, P(None, "x"), w))
  w64 = w.astype(np.float64)
  c = np.cos(xs[0].astype(np.float64) @ w64)
  for _ in range(20):
    for out, x in zip(f(*args), xs):
      _check(out, x.astype(np.float64) @ w64)
    dx, dw = g(args[0][0], args[1])
    _check(dx, c @ w64.T)
    _check(dw, xs[0].astype(np.float64).T @ c)
  print("twice: 20 rounds checked", flush=True)
  return 0


def _mismatch(mesh, rng) -> int:
  """Mode "mismatch" (see the module docstring)."""
  p = mesh.size
  x = rng.standard_normal((6 * p, 10)).astype(np.float32)
  w = rng.standard_normal((10, 3 * p)).astype(np.float32)

  def layer_a(x, w):
    return ficco_jax.all_gather_matmul(x, w, axis_name="x",
                                       schedule=PUSH_GATHER, timeout_s=10.0)

  def layer_b(x, w):
    return ficco_jax.all_gather_matmul(x, w, axis_name="x",
                                       schedule=PUSH_GATHER, timeout_s=10.0)

  # Equal data, so that only the check can tell the two programs apart.
  layer = layer_a if jax.process_index() == 0 else layer_b
  f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"), P(None, "x")),
                            out_specs=P(None, "x")))
  try:
    f(_global(mesh, P("x"), x),
      _global(mesh, P(None, "x"), w)).block_until_ready()
  except Exception as e:  # pylint: disable=broad-exception-caught
    print(f"mismatch: {str(e)[:1500]}", flush=True)
    return 0 if "ran another op at this epoch" in str(e) else 10
  print("mismatch: no error", flush=True)
  return 9


def _barrier(name: str, timeout_s: float = 120.0) -> None:
  """Waits until every process is here, through the job's coordination
  service rather than an XLA collective: NCCL refuses processes that share
  one GPU. (jax has no public barrier outside XLA; ficco's windows use the
  same client for their handles.)"""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def _first_device() -> tuple[int, int]:
  """The platform id, and this process's first device's ordinal as its
  handlers (and the fault hook) see it."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  pid = library.platform_id(jax.default_backend())
  return pid, windows.handler_ordinal(jax.local_devices()[0], pid)


def _recover(mesh, x, w) -> int:
  """Mode "recover" (see the module docstring)."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  pid, ordinal = _first_device()
  ref = x.astype(np.float64) @ w.astype(np.float64)
  f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
  _check(f(*args), ref)
  counts = []
  for i in range(4):
    _barrier(f"recover {i} armed")
    step = ("start", "wait")[i % 2]
    if me == 1:
      library.set_fault(ordinal, step)
    try:
      _check(f(*args), ref)
      print(f"recover: call {i} ({step} fails) right", flush=True)
      if me == 1 or step == "start":
        return 11
    except Exception as e:  # pylint: disable=broad-exception-caught
      print(f"recover: call {i} ({step} fails) failed: {str(e)[:300]}",
            flush=True)
      if not any(c in str(e) for c in ("test hook", "never signalled")):
        return 12
    finally:
      library.clear_faults()
    time.sleep(1.5)  # Every peer has given up.
    _barrier(f"recover {i} failed")
    jax.clear_caches()
    f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
    _check(f(*args), ref)
    counts.append(windows.window_count(pid))
  print(f"recover: windows {counts}", flush=True)
  # A window's device memory that the other process maps stays (CUDA), and
  # one retired family may still be held when the next is made.
  kept = 1 if jax.default_backend() == "gpu" else 0
  held = len(jax.local_devices())
  grown = [c - counts[0] for c in counts]
  if any(g > kept * k + held for k, g in enumerate(grown)):
    return 13
  return 0


def _alone(mesh, x, w) -> int:
  """Mode "alone" (see the module docstring)."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  _, ordinal = _first_device()
  ref = x.astype(np.float64) @ w.astype(np.float64)
  f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
  _check(f(*args), ref)
  _barrier("alone armed")
  if me == 1:
    library.set_fault(ordinal, "start")
  try:
    _check(f(*args), ref)
    return 21  # A failed start fails every process's call.
  except Exception as e:  # pylint: disable=broad-exception-caught
    print(f"alone: the faulted call failed: {str(e)[:200]}", flush=True)
  finally:
    library.clear_faults()
  time.sleep(1.5)  # Every peer has given up.
  _barrier("alone failed")
  if me == 1:
    windows.EXCHANGE_TIMEOUT_S, before = 2.0, windows.EXCHANGE_TIMEOUT_S
    for i in range(2):
      jax.clear_caches()
      f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
      try:
        f(*args)
        return 22  # Process 0 has not lowered again: nothing to pair with.
      except RuntimeError as e:
        if "did not come within" not in str(e):
          raise
        print(f"alone: lowering alone {i} timed out", flush=True)
    windows.EXCHANGE_TIMEOUT_S = before
  _barrier("alone retried", timeout_s=60.0)
  jax.clear_caches()
  f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
  for _ in range(3):
    _check(f(*args), ref)
  print("alone: paired and right after lowering again together", flush=True)
  return 0


def _shapes(mesh, x, w) -> int:
  """Mode "shapes" (see the module docstring)."""
  p = mesh.size
  rows = 4 * (1 + jax.process_index())  # Differs between the processes.
  f, _ = _dma_all_gather(mesh, np.zeros((rows * p, 10), np.float32),
                         np.zeros((10, 3 * p), np.float32), timeout_s=1.0)
  spec = lambda shape, s: jax.ShapeDtypeStruct(
      shape, np.float32, sharding=NamedSharding(mesh, s))
  try:
    f.lower(spec((rows * p, 10), P("x")), spec((10, 3 * p), P(None, "x")))
    return 32
  except ValueError as e:
    print(f"shapes: {e}", flush=True)
    if "the same shapes" not in str(e):
      return 31
  # Once both have failed (a window still live is taken for what it says),
  # process 1 comes later: process 0 must wait for it rather than take its
  # withdrawn window, which refused the last attempt, for this one.
  _barrier("shapes refused")
  if jax.process_index() == 1:
    time.sleep(1.0)
  f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
  _check(f(*args), x.astype(np.float64) @ w.astype(np.float64))
  print("shapes: paired and right with the same shapes", flush=True)
  return 0


def _late(mesh, x, w) -> int:
  """Mode "late" (see the module docstring)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  windows.EXCHANGE_TIMEOUT_S = 20.0
  if me == 1:
    real, armed = windows._directory.get, [True]  # pylint: disable=protected-access

    def get(key, timeout_s, what="", match=lambda value: True):
      if armed and key.startswith("ficco/window/") and key.endswith("/0"):
        armed.clear()
        client = distributed.global_state.client
        while True:  # Until process 0 has published (and reads ours).
          try:
            client.key_value_try_get(key)
            break
          except Exception:  # pylint: disable=broad-exception-caught
            time.sleep(0.01)
        time.sleep(0.3)
        raise RuntimeError("late: the exchange timed out (simulated)")
      return real(key, timeout_s, what, match)

    windows._directory.get = get  # pylint: disable=protected-access
  else:
    time.sleep(1.0)  # Process 1 publishes first.
  ref = x.astype(np.float64) @ w.astype(np.float64)
  failed = 0
  while True:
    f, args = _dma_all_gather(mesh, x, w, timeout_s=1.0)
    start = time.monotonic()
    try:
      out = f(*args)
      break
    except RuntimeError as e:
      if me == 0 or failed or "simulated" not in str(e):
        raise
      failed += 1
      jax.clear_caches()
  for _ in range(3):
    _check(out, ref)
    out = f(*args)
  print(f"late: process {me} paired after {failed} failed lowering(s),"
        f" {time.monotonic() - start:.1f} s", flush=True)
  return 0


def _threads(mesh, rng, x, w, h, w2) -> int:
  """Mode "threads" (see the module docstring); prints its counts."""
  calls, depth = int(os.environ.get("FICCO_TEST_CALLS", "60")), 8

  tol = 1e-5
  if os.environ.get("FICCO_TEST_SCHEDULE") == "push":
    gpu, m, k, n, dtype, tol = _pallas_case()
    p = mesh.size
    x, w = rng.standard_normal((m * p, k)).astype(dtype), rng.standard_normal(
        (k, n * p)).astype(dtype)
    h, w2 = rng.standard_normal((m * p, k * p)).astype(dtype), \
        rng.standard_normal((k * p, n)).astype(dtype)

  def programs():
    if os.environ.get("FICCO_TEST_SCHEDULE") == "push":
      return _push_programs()
    dma = Schedule(dataflow="direct", comm="dma")
    if os.environ.get("FICCO_TEST_SCHEDULE") == "same":
      # One program, one set of inputs: however the ranks pair the two
      # threads' calls, every result is the same.
      job = (_program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
                      P(None, "x"), dma, timeout_s=2.0),
             (_global(mesh, P("x"), x), _global(mesh, P(None, "x"), w)),
             x.astype(np.float64) @ w)
      return {"all_gather_matmul": job, "all_gather_matmul again": job}
    return {
        "all_gather_matmul": (
            _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
                     P(None, "x"), dma, timeout_s=2.0),
            (_global(mesh, P("x"), x), _global(mesh, P(None, "x"), w)),
            x.astype(np.float64) @ w),
        "matmul_reduce_scatter": (
            _program(ficco_jax.matmul_reduce_scatter, mesh, P(None, "x"),
                     P("x"), P("x"), dma, timeout_s=2.0),
            (_global(mesh, P(None, "x"), h), _global(mesh, P("x"), w2)),
            h.astype(np.float64) @ w2),
    }

  def _push_programs():
    # Both push through the k-th pooled push window of their program.
    return {
        "all_gather_matmul": (
            _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
                     P(None, "x"), PUSH_GATHER, check_vma=gpu, timeout_s=2.0),
            (_global(mesh, P("x"), x), _global(mesh, P(None, "x"), w)),
            x.astype(np.float64) @ w),
        "matmul_reduce_scatter": (
            _program(ficco_jax.matmul_reduce_scatter, mesh, P(None, "x"),
                     P("x"), P("x"), FLAGGED, check_vma=gpu, timeout_s=2.0),
            (_global(mesh, P(None, "x"), h), _global(mesh, P("x"), w2)),
            h.astype(np.float64) @ w2),
    }

  def outcome(out, ref):
    try:
      if isinstance(out, Exception):
        raise out
      _check(out, ref, tol)
      return "right"
    except AssertionError as e:
      return f"wrong result: {e}"
    except Exception as e:  # pylint: disable=broad-exception-caught
      return ("clear: " + str(e)[:1500] if any(c in str(e) for c in CLEAR)
              else str(e)[:2000])

  pid, _ = _first_device()
  for r in range(int(os.environ.get("FICCO_TEST_ROUNDS", "1"))):
    jobs = programs()
    for f, args, ref in jobs.values():  # Compiled before the threads start.
      assert outcome(f(*args), ref) == "right"
    waits = windows.issue_waits(pid)
    report, elapsed = util.dispatch_from_threads(jobs, calls, depth, outcome)
    # How often one thread's handler waited for the other's on a window of
    # this device (Window::issue): XLA runs a program over one device on the
    # thread that dispatched it, so there the two programs' handlers overlap.
    print(f"threads: {report} in {elapsed:.1f} s, issue waits:"
          f" {windows.issue_waits(pid) - waits}", flush=True)
    for name, counts in report.items():
      assert counts["right"] + counts["clear"] == calls, (name, counts)
    # Once every process is here (each peer has given up by then), from one
    # thread, on fresh windows, both programs are right again.
    _barrier(f"threads done {r}")
    jax.clear_caches()
    for name, (f, args, ref) in programs().items():
      got = outcome(f(*args), ref)
      assert got == "right", (name, got)
    _barrier(f"threads checked {r}")
    jax.clear_caches()
  print("threads: right from one thread afterwards", flush=True)
  return 0


def _moe(mesh, rng) -> int:
  """Mode "moe" (see the module docstring)."""
  gpu, p = jax.default_backend() == "gpu", mesh.size
  # GPU: d and f multiples of 128 in bf16, as the grouped kernel takes them.
  t, d, f, e_l, dtype, tol = ((384, 256, 384, 2, jnp.bfloat16, 2e-2) if gpu
                              else (12, 6, 10, 2, np.float32, 1e-5))
  e = p * e_l
  schedule = Schedule(dataflow="direct", comm="dma", transport="window",
                      compute="pallas" if gpu else "xla")

  def layer(x, w1, w2, gs):
    gs = gs[0]
    h = ficco_jax.all_to_all_matmul(x, w1, gs, axis_name="x",
                                    schedule=schedule)
    h = jax.nn.relu(h).astype(x.dtype)
    return ficco_jax.matmul_all_to_all(h, w2, gs, axis_name="x",
                                       num_tokens=t, schedule=schedule)

  run = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 4,
                              out_specs=P("x")))
  weights = 1.0 / np.arange(1, e + 1) ** 1.2  # Zipf-like expert load.
  for _ in range(3):  # Fresh data and routing each call.
    x = rng.standard_normal((p * t, d)).astype(dtype)
    w1 = (rng.standard_normal((e, d, f)) / d ** 0.5).astype(dtype)
    w2 = (rng.standard_normal((e, f, d)) / f ** 0.5).astype(dtype)
    gs = rng.multinomial(t - 2, weights / weights.sum(), size=p).astype(
        np.int32)
    out = run(*(_global(mesh, P("x"), a) for a in (x, w1, w2, gs)))
    # Per token: relu(x @ w1[e]) @ w2[e] for its expert e; 0 past the routed.
    ref = np.zeros((p * t, d))
    x64, w1_64, w2_64 = (np.asarray(a, np.float64) for a in (x, w1, w2))
    for s in range(p):
      ends = np.cumsum(gs[s])
      for i in range(ends[-1]):
        ex = int(np.searchsorted(ends, i, side="right"))
        row = s * t + i
        ref[row] = np.maximum(x64[row] @ w1_64[ex], 0) @ w2_64[ex]
    _check(out, ref, tol)
  print("moe: 3 calls checked", flush=True)
  return 0


def main(mode: str) -> int:
  # The float64 reference is compared at 1e-5: no TF32 on GPUs.
  jax.config.update("jax_default_matmul_precision", "highest")
  p = jax.device_count()
  mesh = jax.make_mesh((p,), ("x",))
  rng = np.random.default_rng(0)  # Same data in every process.
  x = rng.standard_normal((6 * p, 10)).astype(np.float32)
  w = rng.standard_normal((10, 3 * p)).astype(np.float32)
  h = rng.standard_normal((6 * p, 4 * p)).astype(np.float32)
  w2 = rng.standard_normal((4 * p, 5)).astype(np.float32)
  if mode == "ops":
    for schedule in (Schedule(dataflow="direct", num_chunks=2),
                     Schedule(dataflow="ring", num_chunks=3)):
      out = _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
                 P(None, "x"), schedule)
      _check(out, x.astype(np.float64) @ w)
      out = _run(ficco_jax.matmul_reduce_scatter, mesh, h, w2, P(None, "x"),
                 P("x"), P("x"), schedule)
      _check(out, h.astype(np.float64) @ w2)
    return 0
  if mode == "dma":
    for df, c in (("direct", 1), ("direct", 2), ("ring", 3),
                  ("bidirectional", 1), ("bidirectional", 2)):
      schedule = Schedule(dataflow=df, num_chunks=c, comm="dma")
      for _ in range(3):  # Epochs advance; windows are reused.
        out = _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"),
                   P(None, "x"), P(None, "x"), schedule)
        _check(out, x.astype(np.float64) @ w)
        out = _run(ficco_jax.matmul_reduce_scatter, mesh, h, w2,
                   P(None, "x"), P("x"), P("x"), schedule)
        _check(out, h.astype(np.float64) @ w2)
    # dp x tp with tp groups spanning processes (devices are numbered
    # process-major, so a (2, P/2) mesh puts each tp group across them).
    if p % 2 == 0 and p >= 4:
      mesh2 = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(p // 2, 2).T,
                                ("dp", "x"))
      f = jax.jit(jax.shard_map(
          functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                            schedule=Schedule(dataflow="ring", comm="dma")),
          mesh=mesh2, in_specs=(P(("dp", "x")), P(None, "x")),
          out_specs=P("dp", "x")))
      xs = rng.standard_normal((4 * p, 10)).astype(np.float32)
      out = f(_global(mesh2, P(("dp", "x")), xs), _global(mesh2, P(None, "x"), w))
      ref = np.concatenate([xs[k * 2 * len(xs) // p:(k + 1) * 2 * len(xs) // p]
                            for k in range(p // 2)]).astype(np.float64) @ w
      _check(out, ref)
    return 0
  if mode == "push":
    # The flagged reduce-scatter over an axis spanning the processes: with
    # transport=None it pushes (windows and host words exchanged through
    # the key-value store). Fresh data each call, so a piece read from the
    # wrong landing half shows.
    gpu, m, k, n, dtype, tol = _pallas_case()
    w_p = rng.standard_normal((k * p, n)).astype(dtype)
    f = None
    for c in (1, 3):
      schedule = dataclasses.replace(FLAGGED, num_chunks=c)
      f = _program(ficco_jax.matmul_reduce_scatter, mesh, P(None, "x"),
                   P("x"), P("x"), schedule, check_vma=gpu)
      for i in range(4):
        h_p = rng.standard_normal((m * p, k * p)).astype(dtype)
        args = (_global(mesh, P(None, "x"), h_p), _global(mesh, P("x"), w_p))
        if i == 0:
          assert "ficco_push_finish" in f.lower(*args).as_text()
        _check(f(*args), np.asarray(h_p, np.float64) @ np.asarray(
            w_p, np.float64), tol)
    # The push all-gather over the same axis: each shard lands in the
    # other process's window and is multiplied there.
    g = jax.jit(jax.shard_map(
        functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                          schedule=Schedule(dataflow="direct", comm="dma",
                                            compute_granularity="flagged")),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
    for i in range(4):
      x_p = rng.standard_normal((m * p, k)).astype(dtype)
      wg = rng.standard_normal((k, n * p)).astype(dtype)
      args_g = (_global(mesh, P("x"), x_p), _global(mesh, P(None, "x"), wg))
      if i == 0:
        assert "ficco_push_gather" in g.lower(*args_g).as_text()
      _check(g(*args_g), np.asarray(x_p, np.float64) @ np.asarray(
          wg, np.float64), tol)
    # The signalled all-gather over the same axis: each process pulls the
    # other's shard through the window transport, and its kernel waits on
    # the landing flags (on CPU, the landing buffers' plain waits).
    for c in (1, 2):
      sg = _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
                    P(None, "x"), dataclasses.replace(FLAGGED, num_chunks=c),
                    check_vma=gpu)
      for i in range(4):
        x_p = rng.standard_normal((m * p, k)).astype(dtype)
        args_s = (_global(mesh, P("x"), x_p), _global(mesh, P(None, "x"), wg))
        if i == 0:
          assert "ficco_window_start" in sg.lower(*args_s).as_text()
        _check(sg(*args_s), np.asarray(x_p, np.float64) @ np.asarray(
            wg, np.float64), tol)
    # The rendezvous transport cannot reach the other process: asked for,
    # it is a clear error naming the schedule's field.
    schedule = dataclasses.replace(schedule, transport="rendezvous")
    f = _program(ficco_jax.matmul_reduce_scatter, mesh, P(None, "x"), P("x"),
                 P("x"), schedule, check_vma=gpu)
    try:
      f(*args)
    except ValueError as e:
      return 0 if "transport='rendezvous'" in str(e) else 8
    return 9
  if mode == "otherhost":
    # Each process claims a host of its own.
    windows.hostname = lambda: f"host{jax.process_index()}"
    try:
      _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
           P(None, "x"), Schedule(dataflow="ring", comm="dma"))
    except ValueError as e:
      return 0 if "Schedule(comm='xla')" in str(e) else 3
    return 4  # comm="dma" must not run across hosts.
  if mode == "stall":
    f = jax.jit(jax.shard_map(
        functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                          schedule=Schedule(dataflow="direct", comm="dma"),
                          timeout_s=3.0),
        mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
    args = (_global(mesh, P("x"), x), _global(mesh, P(None, "x"), w))
    f(*args).block_until_ready()
    flag = os.environ["FICCO_TEST_STALL_FILE"]
    if jax.process_index() == 1:
      # Never arrives again; leaves once process 0 has seen its error.
      deadline = time.monotonic() + 120
      while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.1)
      seen = os.path.exists(flag)
      with open(flag + ".left", "w") as fh:
        fh.write("leaving")
      os._exit(0 if seen else 5)
    start = time.monotonic()
    try:
      # On CUDA the failure surfaces at the next call (the watchdog poisons
      # the window after the deadline), so allow a few.
      for _ in range(3):
        f(*args).block_until_ready()
    except Exception as e:  # pylint: disable=broad-except
      took = time.monotonic() - start
      msg = str(e)
      print(f"stall: failed after {took:.1f}s: {msg[:300]}", flush=True)
      late = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == 1]
      ok = any(f"rank {r} " in msg for r in late) and took < 30
      with open(flag, "w") as fh:
        fh.write(msg)
      # Process 0 hosts the coordination service: leaving before process 1
      # has gone makes process 1's agent see the socket close and abort.
      deadline = time.monotonic() + 60
      while (not os.path.exists(flag + ".left")
             and time.monotonic() < deadline):
        time.sleep(0.05)
      time.sleep(1.0)
      os._exit(0 if ok else 6)  # Skip the distributed shutdown barrier.
    return 7  # No error: the missing peer went unnoticed.
  if mode == "die":
    if jax.process_index() == 1:
      # Die like a crashed process: no exit handlers, so no distributed
      # shutdown barrier that would hold this process until the peers leave.
      os._exit(7)
    # Waits for process 1 forever: the launcher has to stop it.
    _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
         P(None, "x"), Schedule(dataflow="none")).block_until_ready()
    return 0
  if mode == "raise":
    out = _run(ficco_jax.all_gather_matmul, mesh, x, w, P("x"), P(None, "x"),
               P(None, "x"), Schedule(dataflow="ring"))
    out.block_until_ready()
    if jax.process_index() == 1:
      raise RuntimeError("boom from process 1")
    _run(ficco_jax.matmul_reduce_scatter, mesh, h, w2, P(None, "x"), P("x"),
         P("x"), Schedule(dataflow="ring")).block_until_ready()
    return 0
  if mode == "loop":
    # A long timeout: the launcher, not the op, must end the job when a
    # process dies.
    f, args = _dma_all_gather(mesh, x, w, timeout_s=60.0)
    f(*args).block_until_ready()
    with open(os.path.join(os.environ["FICCO_TEST_PID_DIR"],
                           str(jax.process_index())), "w") as fh:
      fh.write(str(os.getpid()))
    print(f"loop: process {jax.process_index()} running", flush=True)
    while True:
      f(*args).block_until_ready()
  if mode == "hang":
    if os.environ.get("FICCO_TEST_SCHEDULE") == "signalled":
      f, args = _signalled_all_gather(mesh, rng, timeout_s=3.0)
    else:
      f, args = _dma_all_gather(mesh, x, w, timeout_s=3.0)
    f(*args).block_until_ready()
    if jax.process_index() == 1:
      with open(os.environ["FICCO_TEST_STALL_FILE"], "w") as fh:
        fh.write(f"{time.time()} {os.getpid()}")
      time.sleep(3600)
    for _ in range(3):  # Raises: process 1 never takes part again.
      f(*args).block_until_ready()
    return 7
  if mode == "alternate":
    tol = 1e-5
    if os.environ.get("FICCO_TEST_SCHEDULE") == "flagged":
      # The signalled all-gather and the flagged (pushing) reduce-scatter,
      # Pallas compute: on GPUs bf16 pieces of whole Hopper tiles.
      gpu, m, k, n, dtype, tol = _pallas_case()
      x, w = np.zeros((m * p, k), dtype), rng.standard_normal(
          (k, n * p)).astype(dtype)
      h, w2 = np.zeros((m * p, k * p), dtype), rng.standard_normal(
          (k * p, n)).astype(dtype)
      ag = _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
                    P(None, "x"), FLAGGED, check_vma=gpu)
      rs = _program(ficco_jax.matmul_reduce_scatter, mesh, P(None, "x"),
                    P("x"), P("x"), FLAGGED, check_vma=gpu)
    else:
      ag = _program(ficco_jax.all_gather_matmul, mesh, P("x"), P(None, "x"),
                    P(None, "x"), Schedule(dataflow="direct", comm="dma"))
      rs = _program(ficco_jax.matmul_reduce_scatter, mesh, P(None, "x"),
                    P("x"), P("x"), Schedule(dataflow="direct", comm="dma"))
    # Inputs that change every call, so that a piece of another call (or of
    # the other program) shows in the result.
    xs = [rng.standard_normal(x.shape).astype(x.dtype) for _ in range(3)]
    hs = [rng.standard_normal(h.shape).astype(h.dtype) for _ in range(3)]
    ag_args = [(_global(mesh, P("x"), a), _global(mesh, P(None, "x"), w))
               for a in xs]
    rs_args = [(_global(mesh, P(None, "x"), a), _global(mesh, P("x"), w2))
               for a in hs]
    calls = int(os.environ.get("FICCO_TEST_CALLS", "200"))
    for i in range(calls // 2):
      k = i % 3
      out_ag, out_rs = ag(*ag_args[k]), rs(*rs_args[k])
      _check(out_ag, xs[k].astype(np.float64) @ w.astype(np.float64), tol)
      _check(out_rs, hs[k].astype(np.float64) @ w2.astype(np.float64), tol)
    print(f"alternate: {calls // 2 * 2} calls checked", flush=True)
    return 0
  if mode == "threads":
    return _threads(mesh, rng, x, w, h, w2)
  if mode == "mismatch":
    return _mismatch(mesh, rng)
  if mode == "recover":
    return _recover(mesh, x, w)
  if mode == "alone":
    return _alone(mesh, x, w)
  if mode == "shapes":
    return _shapes(mesh, x, w)
  if mode == "late":
    return _late(mesh, x, w)
  if mode == "twice":
    return _twice(mesh, rng)
  if mode == "moe":
    return _moe(mesh, rng)
  if mode == "sleep":
    import signal  # pylint: disable=g-import-not-at-top
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(os.environ["FICCO_TEST_PID_DIR"],
                           str(os.getpid())), "w") as fh:
      fh.write("up")
    time.sleep(300)
    return 0
  raise ValueError(f"unknown {mode=}")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
