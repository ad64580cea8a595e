"""The peer-copy protocol (docs/protocol.md) end to end on its CPU twin.

Gathers shards with start/wait/done inside jit(shard_map) on 8 virtual CPU
devices and compares with lax.all_gather, bit for bit; checks that repeated
calls reuse every event and free every invocation, and that a peer that never
arrives fails the op within its timeout without breaking later calls. Where
there are >= 4 GPUs and the CUDA handlers are compiled in, the same tests run
on them too.
"""

import os
import sys

if "jax" not in sys.modules:  # Standalone runs; conftest.py does the same.
  _flag = "--xla_force_host_platform_device_count=8"
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                               _flag).strip()

import time  # pylint: disable=g-import-not-at-top

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ficco_jax._src import plan as plan_lib
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import vma
from ficco_jax._src.dma import library
from ficco_jax._src.dma import peer_copy

import util

pytestmark = pytest.mark.multigpu

TIMEOUT_S = 30.0
SHARD_ROWS = 6  # divisible by 1 and 3 chunks, not a power of two


def _devices(platform):
  if platform == "cpu":
    return jax.devices("cpu")
  if not library.cuda_compiled():
    pytest.skip("CUDA handlers not compiled in")
  try:
    return jax.devices("cuda")
  except RuntimeError:
    pytest.skip("no CUDA backend")


@pytest.fixture(params=[("cpu", "last"), ("cpu", "async"), ("cuda", "async"),
                        ("cuda", "parallel")],
                ids=lambda p: "-".join(p))
def platform(request):
  """The platform, with each issue mode it supports (docs/protocol.md): the
  CPU twin's default and the async issuer threads; CUDA's default (async)
  and parallel issue."""
  name, mode = request.param
  _devices(name)  # Skips where the platform is missing.
  previous = library.set_issue_mode(mode, name)
  yield name
  library.set_issue_mode(previous, name)


def _mesh(platform, layout):
  """``layout``: "4" (1-D), "2x4" (gathered axis minor), "4x2" (major)."""
  shape, names = {"4": ((4,), ("x",)), "2x4": ((2, 4), ("y", "x")),
                  "4x2": ((4, 2), ("x", "y"))}[layout]
  devices = _devices(platform)
  need = int(np.prod(shape))
  if len(devices) < need:
    pytest.skip(f"needs {need} {platform} devices, has {len(devices)}")
  return Mesh(np.asarray(devices[:need]).reshape(shape), names)


def _plan(dataflow, num_chunks, axis_size=4, shard_rows=SHARD_ROWS):
  schedule = schedule_lib.Schedule(dataflow=dataflow, num_chunks=num_chunks,
                                   comm="dma")
  return plan_lib.gather_plan(schedule, axis_size=axis_size,
                              shard_rows=shard_rows)


def _gather(x, plan, *, op_name="test_gather", timeout_s=TIMEOUT_S):
  """all_gather(x, "x", tiled=True) through the protocol, used as the library
  uses it: barriers order the waits, done keeps the peers' reads alive."""
  site = peer_copy.new_site()
  landings = peer_copy.start([x], plan, axis_name="x", site=site,
                             op_name=op_name, timeout_s=timeout_s)
  x_ordered, landings = lax.optimization_barrier((x, list(landings)))
  pieces = {0: [(0, x_ordered)]}  # owner offset -> [(owner row, rows)]
  waited = []
  for b, landing in enumerate(landings):
    buf = peer_copy.wait(landing, axis_name="x", site=site, op_name=op_name,
                         timeout_s=timeout_s)
    waited.append(buf)
    for blk in plan.blocks_of(b):
      pieces.setdefault(blk.owner_offset, []).append(
          (blk.owner_row, buf[blk.landing_row:blk.landing_row + blk.rows]))
  by_offset = jnp.stack([
      jnp.concatenate([rows for _, rows in sorted(pieces[o],
                                                  key=lambda t: t[0])])
      for o in range(plan.axis_size)])
  # Shard k of the result is owned by rank k, at offset (k - r) % P.
  r = lax.axis_index("x")
  order = (jnp.arange(plan.axis_size) - r) % plan.axis_size
  gathered = by_offset[order].reshape((-1,) + x.shape[1:])
  keepalive = [x] + [waited[b] for b in plan.forwarded_landings]
  return peer_copy.done(gathered, keepalive, axis_name="x", site=site,
                        op_name=op_name, timeout_s=timeout_s)


def _spec(mesh):
  return P(tuple(mesh.axis_names)) if len(mesh.axis_names) > 1 else P("x")


def _input(mesh, row_shape, scale=1):
  rows = SHARD_ROWS * mesh.devices.size
  x = scale * np.arange(rows * int(np.prod(row_shape)), dtype=np.float32)
  x = x.reshape((rows,) + tuple(row_shape))
  return jax.device_put(x, NamedSharding(mesh, _spec(mesh)))


def _shard_map(mesh, body, num_outputs):
  spec = _spec(mesh)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                               out_specs=(spec,) * num_outputs))


def _reference(x):
  return lax.all_gather(x, "x", tiled=True)


def _assert_gathered(out, x):
  """On the 1-D mesh, out_specs=P("x") stacks every device's gathered copy."""
  x = np.asarray(x)
  np.testing.assert_array_equal(np.asarray(out), np.concatenate([x] * 4))


def _assert_idle(platform):
  # Peers' done calls may still be returning on their threads.
  deadline = time.monotonic() + 5
  while library.live_invocations(platform) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert library.live_invocations(platform) == 0
  assert library.pending_entries(platform) == 0


@pytest.mark.parametrize("layout", ["4", "2x4", "4x2"])
@pytest.mark.parametrize("dataflow", ["direct", "ring", "bidirectional"])
@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("row_shape", [(5,), (2, 3)])
def test_gather_matches_all_gather(platform, layout, dataflow, num_chunks,
                                   row_shape):
  if layout == "4x2" and row_shape != (5,):
    pytest.skip("one row shape is enough for the axis-major layout")
  mesh = _mesh(platform, layout)
  plan = _plan(dataflow, num_chunks)
  f = _shard_map(mesh, lambda x: (_gather(x, plan), _reference(x)), 2)
  out, ref = f(_input(mesh, row_shape))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  _assert_idle(platform)


def test_compiled_program_aliases_and_keeps_ops(platform):
  mesh = _mesh(platform, "4")
  plan = _plan("ring", 3)
  f = _shard_map(mesh, lambda x: (_gather(x, plan),), 1)
  hlo = f.lower(_input(mesh, (5,))).compile().as_text()
  assert hlo.count('custom_call_target="ficco_peer_copy_start"') == 1
  # One sync per wait, plus one for the done.
  assert hlo.count('custom_call_target="ficco_peer_copy_sync"') == len(
      plan.landing_rows) + 1
  assert "output_to_operand_aliasing" in hlo


def test_scan_runs_one_site_five_times(platform):
  mesh = _mesh(platform, "4")
  plan = _plan("ring", 3)

  def body(x):
    def step(carry, i):
      y = x + i.astype(x.dtype)
      return carry, (_gather(y, plan), _reference(y))
    _, (outs, refs) = lax.scan(step, 0, jnp.arange(5))
    return outs, refs

  outs, refs = _shard_map(mesh, body, 2)(_input(mesh, (5,)))
  assert outs.shape[0] == 5 * 4
  np.testing.assert_array_equal(np.asarray(outs), np.asarray(refs))
  _assert_idle(platform)


def test_two_call_sites_in_one_program(platform):
  mesh = _mesh(platform, "2x4")
  direct, ring = _plan("direct", 3), _plan("ring", 1)

  def body(x):
    # The same operand gathered twice: both invocations have one sources[0],
    # done must still pair each with its own start.
    a = _gather(x, direct, op_name="first")
    b = _gather(x, ring, op_name="second")
    c = _gather(2 * x, direct, op_name="third")
    ref = _reference(x)
    return a, b, c, ref

  a, b, c, ref = _shard_map(mesh, body, 4)(_input(mesh, (2, 3)))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(b), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(c), 2 * np.asarray(ref))
  _assert_idle(platform)


def test_one_sync_waits_for_and_ends_several_invocations(platform):
  """sync: every landing buffer of three starts awaited, and the three
  invocations ended, in one call (what the direct reduce-scatter does)."""
  mesh = _mesh(platform, "4")
  plans = [_plan("direct", 1), _plan("ring", 3), _plan("direct", 3)]
  kw = dict(axis_name="x", op_name="batched", timeout_s=TIMEOUT_S)

  def body(x):
    started = []
    for k, plan in enumerate(plans):
      site = peer_copy.new_site()
      src = (k + 1) * x
      started.append((src, site, peer_copy.start([src], plan, site=site,
                                                  **kw)))
    # Forwarded landings must be kept alive by their waits' outputs, so a
    # ring needs its waits before its done: end only the plans that forward
    # nothing, and the ring with its own done.
    landings = [(buf, site) for _, site, bufs in started for buf in bufs]
    ends = [([src], site) for (src, site, _), plan in zip(started, plans)
            if not plan.forwarded_landings]
    waited = peer_copy.sync(landings, ends, **kw)
    ring_src, ring_site, ring_bufs = started[1]
    first = len(started[0][2])
    ring_waited = waited[first:first + len(ring_bufs)]
    keep = [ring_src] + [ring_waited[b] for b in plans[1].forwarded_landings]
    total = sum(jnp.sum(w) for w in waited)
    total = peer_copy.done(total, keep, site=ring_site, **kw)
    return (jnp.broadcast_to(total, x.shape),)

  f = _shard_map(mesh, body, 1)
  x = _input(mesh, (5,))
  hlo = f.lower(x).compile().as_text()
  assert hlo.count('custom_call_target="ficco_peer_copy_start"') == 3
  assert hlo.count('custom_call_target="ficco_peer_copy_sync"') == 2
  out = np.asarray(f(x)[0])
  # Every rank receives the other three shards once per plan, scaled by
  # 1, 2, 3: the sum of everything but its own shard, times 6.
  xs = np.asarray(x).reshape(4, -1)
  for r in range(4):
    expect = 6 * (xs.sum() - xs[r].sum())
    np.testing.assert_allclose(out[r * SHARD_ROWS:(r + 1) * SHARD_ROWS],
                               expect, rtol=1e-6)
  _assert_idle(platform)


def test_sync_needs_something_to_return():
  with pytest.raises(ValueError, match="landing buffer or `out`"):
    peer_copy.sync([], [], axis_name="x", op_name="t", timeout_s=1)


def test_two_jitted_functions_alternating(platform):
  mesh = _mesh(platform, "4")
  f = _shard_map(mesh, lambda x: (_gather(x, _plan("direct", 3)),), 1)
  g = _shard_map(mesh, lambda x: (_gather(x, _plan("bidirectional", 1)),), 1)
  xs = [_input(mesh, (5,), scale=i + 1) for i in range(4)]
  # Dispatched back to back without blocking, so executions may overlap.
  outs = [(fn(x)[0], x) for x in xs for fn in (f, g)]
  for out, x in outs:
    _assert_gathered(out, x)
  _assert_idle(platform)


def test_1000_calls_allocate_nothing_new(platform):
  mesh = _mesh(platform, "4")
  plan = _plan("ring", 3)
  f = _shard_map(mesh, lambda x: (_gather(x, plan),), 1)
  x = _input(mesh, (5,))
  ordinals = [d.local_hardware_id for d in mesh.devices.flat]

  def calls(n):
    for i in range(n):
      out = f(x)[0]
      if i % 100 == 99:
        out.block_until_ready()  # Bounds the executions in flight.
    return out

  # Warm up with the same pattern: the pools grow to the invocations in
  # flight at once, which the async issuers (running behind the starts) let
  # run deeper than one call.
  calls(300).block_until_ready()
  _assert_idle(platform)
  created = [library.event_counts(o, platform)[0] for o in ordinals]
  out = calls(1000)
  _assert_gathered(out, x)
  _assert_idle(platform)
  for o, before in zip(ordinals, created):
    now, pooled = library.event_counts(o, platform)
    # A leak would create events on every call (4 per call here); a deeper
    # moment in flight than during the warm-up may add a few.
    assert now - before <= 40, f"device {o} created {now - before} more events"
    assert pooled == now, f"device {o}: {now - pooled} events not returned"


@pytest.mark.parametrize("dataflow", ["direct", "ring"])
def test_host_stats_count_handlers_and_stream_waits(platform, dataflow):
  mesh = _mesh(platform, "4")
  plan = _plan(dataflow, 3)
  f = _shard_map(mesh, lambda x: (_gather(x, plan),), 1)
  x = _input(mesh, (5,))
  f(x)[0].block_until_ready()
  _assert_idle(platform)
  library.reset_host_stats(platform)
  calls, devices = 5, 4
  for _ in range(calls):
    out = f(x)[0]
  _assert_gathered(out, x)
  _assert_idle(platform)
  stats = library.host_stats(platform)
  syncs = len(plan.landing_rows) + 1  # one wait per landing, one done
  assert stats["start"][0] == calls * devices
  assert stats["sync"][0] == calls * devices * syncs
  assert stats["start"][1] > 0 and stats["sync"][1] > 0
  if library.issue_mode(platform) == "last":
    assert stats["start_rendezvous"][0] == 0  # Nobody waits for peers.
  else:
    # Each device's issuer (async) or start (parallel) waited for its
    # peers and issued its copies once per call.
    assert stats["start_rendezvous"][0] == calls * devices
    assert stats["start_issue"][0] == calls * devices
  if platform == "cuda":
    # Each rank waits for its own copies; a wait enqueues one stream wait
    # per copy queue into its landing buffer, a done one per (reader, queue)
    # of the copies that read this rank's shard: the newest event of a
    # queue implies the older ones.
    p = plan.axis_size
    per_rank = sum(len({t.stream for t in plan.transfers if t.dst == b})
                   for b in range(len(plan.landing_rows)))
    per_rank += len({((-t.src_offset) % p, t.stream) for t in plan.transfers})
    assert stats["sync_waits"][0] == calls * devices * per_rank
  library.reset_host_stats(platform)
  assert all(v == (0, 0.0) for v in library.host_stats(platform).values())


# The timeline is a build option (FICCO_TRACE); the default build has none.
needs_trace = pytest.mark.skipif(
    not library.trace_compiled(),
    reason="built without FICCO_TRACE (pip install ."
           " -Ccmake.define.FICCO_TRACE=ON)")


@pytest.mark.skipif(library.trace_compiled(), reason="built with FICCO_TRACE")
def test_trace_without_the_build_option_says_how_to_get_it():
  with pytest.raises(ValueError, match="capacity=-1"):
    library.trace_enable(-1)
  with pytest.raises(RuntimeError, match="FICCO_TRACE=ON"):
    library.trace_enable(10)
  library.trace_disable()
  assert library.trace_read(10) == ([], 0)


def _traced_calls(platform, plan, calls, *, capacity, gpu_stamps=0,
                  marks=False):
  """Runs a gather `calls` times under the host timeline (and `gpu_stamps`
  GPU stamps per device), after a warm-up; returns the mesh, the compiled
  gather and `trace_read`'s ``(events, recorded)``."""
  mesh = _mesh(platform, "4")
  f = _shard_map(mesh, lambda x: (_gather(x, plan),), 1)
  x = _input(mesh, (5,))
  f(x)[0].block_until_ready()
  _assert_idle(platform)
  library.trace_enable(capacity)
  if gpu_stamps:
    library.trace_gpu_enable(gpu_stamps)
  try:
    for i in range(calls):
      if marks:
        library.trace_mark(-1, i)
      out = f(x)[0]
    _assert_gathered(out, x)
    _assert_idle(platform)
  finally:
    library.trace_disable()
  return mesh, lambda: f(x)[0], library.trace_read(max(capacity, 100))


@needs_trace
def test_host_trace_records_every_handler_in_order(platform):
  plan = _plan("direct", 3)
  calls = 4
  syncs = len(plan.landing_rows) + 1  # one wait per landing, one done
  mesh, run, (events, recorded) = _traced_calls(
      platform, plan, calls, capacity=10_000, marks=True)
  assert recorded == len(events)
  count = lambda point, device=None: sum(
      e["point"] == point and device in (None, e["device"]) for e in events)
  assert [e["tag"] for e in events if e["point"] == "mark"] == list(range(calls))
  ordinals = sorted({d.local_hardware_id for d in mesh.devices.flat})
  for o in ordinals:
    assert count("start_enter", o) == count("start_exit", o) == calls, o
    assert count("sync_enter", o) == count("sync_exit", o) == calls * syncs
    if library.issue_mode(platform) == "last":
      assert count("issue_begin", o) == 0
    else:
      assert count("issue_begin", o) == count("issue_end", o) == calls, o
      assert count("peers_arrived", o) == calls, o
    # Each device's handlers run in program order on its thread: every
    # start enters after the previous one left, and so does every sync.
    for enter, leave in (("start_enter", "start_exit"),
                         ("sync_enter", "sync_exit")):
      seq = [e for e in events if e["device"] == o and e["point"] in
             (enter, leave)]
      seq.sort(key=lambda e: e["t_ns"])
      assert [e["point"] for e in seq] == [enter, leave] * (len(seq) // 2)
  assert all(e["cpu"] >= 0 for e in events)
  starts = {e["tag"] for e in events if e["point"] == "start_enter"}
  assert len(starts) == 1 and starts.pop() >= 0  # One call site.
  # Disabled: nothing more is recorded; a new trace starts empty.
  run().block_until_ready()
  assert library.trace_read(10_000)[1] == recorded
  library.trace_enable(3)
  library.trace_disable()
  assert library.trace_read(10)[1] == 0


@needs_trace
def test_gpu_stamps_follow_every_start_sync_and_copy(platform):
  if platform != "cuda":
    pytest.skip("GPU stamps are CUDA only")
  plan = _plan("direct", 3)
  calls = 3
  mesh, _, (events, _) = _traced_calls(platform, plan, calls,
                                       capacity=10_000, gpu_stamps=1_000)
  syncs = len(plan.landing_rows) + 1
  for d in mesh.devices.flat:
    o = d.local_hardware_id
    mine = [e for e in events if e["device"] == o and
            e["point"].startswith("gpu_")]
    times = library.trace_gpu_times(o, 1_000)
    assert sorted(e["tag"] for e in mine) == list(range(len(times)))
    count = lambda p: sum(e["point"] == p for e in mine)
    assert count("gpu_start") == calls
    assert count("gpu_sync_in") == count("gpu_sync_out") == calls * syncs
    copies = len(plan.transfers)  # Every rank runs the plan's transfers.
    assert count("gpu_copy_begin") == count("gpu_copy_end") == calls * copies
    # The compute stream runs its stamps in the order they were enqueued.
    compute = [times[e["tag"]] for e in sorted(mine, key=lambda e: e["t_ns"])
               if e["point"] in ("gpu_start", "gpu_sync_in", "gpu_sync_out")]
    assert compute == sorted(compute) and times[0] == 0


@needs_trace
def test_host_trace_overflow_keeps_the_first_events(platform):
  _, _, (events, recorded) = _traced_calls(platform, _plan("ring", 3), 3,
                                           capacity=5)
  assert len(events) == 5 and recorded > 5
  with pytest.raises(ValueError, match="capacity=-1"):
    library.trace_enable(-1)


def test_peer_that_never_arrives_times_out_then_recovers(platform):
  mesh = _mesh(platform, "4")
  plan = _plan("direct", 1)
  timeout_s = 1.0
  f = _shard_map(
      mesh,
      lambda x: (_gather(x, plan, op_name="stalled_op", timeout_s=timeout_s),),
      1)
  x = _input(mesh, (5,))
  f(x)[0].block_until_ready()  # Compiled and warm: time only the stall.
  missing = mesh.devices.flat[2].local_hardware_id
  with util.never_arriving(missing):
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
      f(x)[0].block_until_ready()
    elapsed = time.monotonic() - t0
  message = str(info.value)
  assert "stalled_op" in message
  assert f"device {missing}" in message
  assert elapsed < timeout_s + 10, elapsed
  # The timed-out ranks abandoned their invocation: nothing stale is left to
  # match, and the next execution works.
  _assert_idle(platform)
  _assert_gathered(f(x)[0], x)
  _assert_idle(platform)


def test_timeout_message_names_missing_rank(platform):
  mesh = _mesh(platform, "4")
  plan = _plan("ring", 1)
  f = _shard_map(
      mesh, lambda x: (_gather(x, plan, op_name="ring_op", timeout_s=0.5),), 1)
  x = _input(mesh, (5,))
  missing = mesh.devices.flat[1].local_hardware_id
  with util.never_arriving(missing), pytest.raises(Exception) as info:
    f(x)[0].block_until_ready()
  # jax reports one device's error: the hooked device's own, or a peer's
  # timeout, which names the missing rank.
  message = str(info.value)
  assert "ring_op" in message
  assert (f"rank 1 (device {missing})" in message or
          f"device {missing}: test hook" in message), message
  _assert_idle(platform)


def test_start_validates_its_operands():
  mesh = _mesh("cpu", "4")
  plan = _plan("direct", 1)

  def mismatched(x):
    return tuple(peer_copy.start([x, x.astype(jnp.int32)], plan,
                                 axis_name="x", site=peer_copy.new_site(), op_name="t", timeout_s=1))

  with pytest.raises(ValueError, match="share dtype"):
    _shard_map(mesh, mismatched, 1).lower(_input(mesh, (5,)))

  wrong_size = _plan("direct", 1, axis_size=2)
  with pytest.raises(ValueError, match="axis_size"):
    _shard_map(mesh, lambda x: (_gather(x, wrong_size),), 1).lower(
        _input(mesh, (5,)))


def _thread_names():
  """The names of this process's threads, as /proc shows them."""
  names = set()
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as fh:
        names.add(fh.read().strip())
    except OSError:  # The thread exited in between.
      continue
  return names


def test_async_issue_runs_on_named_issuer_threads():
  """The CPU twin's issue mode is "last" unless the C API selects another
  (nothing in the environment does); "parallel" is refused there. Under
  "async" each device's copies are issued by a thread of ficco's own, named
  ficco-issue-<device> so that /proc and profilers tell it apart, and the
  gather stays exact over repeated calls."""
  assert library.issue_mode("cpu") == "last"
  with pytest.raises(ValueError, match="not supported"):
    library.set_issue_mode("parallel", "cpu")
  assert library.issue_mode("cpu") == "last"
  mesh = _mesh("cpu", "4")
  plan = _plan("ring", 3)
  f = _shard_map(mesh, lambda x: (_gather(x, plan), _reference(x)), 2)
  x = _input(mesh, (5,))
  previous = library.set_issue_mode("async", "cpu")
  try:
    assert previous == "last"
    assert library.issue_mode("cpu") == "async"
    for _ in range(3):
      out, ref = f(x)
      np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    _assert_idle("cpu")
  finally:
    library.set_issue_mode(previous, "cpu")
  assert library.issue_mode("cpu") == "last"
  ordinals = [d.id if getattr(d, "local_hardware_id", None) is None
              else d.local_hardware_id for d in mesh.devices.flat]
  names = _thread_names()
  missing = {f"ficco-issue-{o}" for o in ordinals} - names
  assert not missing, (missing, sorted(names))


def _roll_plan(rows):
  """Rank r pulls all ``rows`` of rank r + 1, on one copy queue."""
  return plan_lib.GatherPlan(
      axis_size=4, shard_rows=rows, landing_rows=(rows,),
      transfers=(plan_lib.Transfer(dst=0, dst_row=0, src_offset=1, src=0,
                                   src_row=0, rows=rows, stream=0),),
      blocks=(), num_streams=1)


def _flagged_roll(x, *, bump, timeout_s):
  """Rank r's rows from rank r + 1 through a flagged start: the copy waits
  for the source's flag 1 to reach 5 (``bump`` sets it; without, it never
  does). Returns them and the arm's rank."""
  plan = _roll_plan(x.shape[0])
  site = peer_copy.new_site()
  kw = dict(axis_name="x", site=site, op_name="test_flagged")
  flags, rank, landings = peer_copy.arm(x, 2, plan, dtype=x.dtype,
                                        row_shape=x.shape[1:], **kw)
  if bump:  # What the kernel does as it writes the rows.
    flags = flags + jnp.asarray([0, 5], jnp.int32)
  landing = peer_copy.start([x], plan, flags=flags, landings=landings,
                            flag_target=5, src_flags=(1,),
                            timeout_s=timeout_s, **kw)[0]
  del kw["site"]
  return peer_copy.sync([(landing, site)], [([x, flags], site)],
                        timeout_s=timeout_s, **kw)[0], rank


def test_flagged_start_copies_once_the_flag_is_set(platform):
  """The CPU twin copies once the flag is set. Here the flags are bumped by
  an XLA add, into a new buffer: CUDA's start refuses that (its flag stream
  would wait on a buffer nobody bumps), as it must; test_ops's flagged
  schedules run the kernel that bumps them in place."""
  mesh = _mesh(platform, "4")
  f = _shard_map(mesh, lambda x: (_flagged_roll(x, bump=True,
                                                timeout_s=TIMEOUT_S)[0],), 1)
  x = _input(mesh, (5,))
  if platform == "cuda":
    with pytest.raises(Exception, match="differ from those ficco_flags_arm"):
      jax.block_until_ready(f(x))
    _assert_idle(platform)
    return
  for _ in range(3):  # Arm and start pair up again on every execution.
    (out,) = f(x)
  np.testing.assert_array_equal(
      np.asarray(out), np.roll(np.asarray(x), -SHARD_ROWS, axis=0))
  _assert_idle(platform)


@pytest.mark.parametrize("layout", ["4", "2x4", "4x2"])
def test_arm_writes_the_rank_on_the_axis(layout):
  """The arm's rank is lax.axis_index of the gathered axis, also where the
  device's position in the mesh differs from it (2-D meshes)."""
  mesh = _mesh("cpu", layout)

  def body(x):
    out, rank = _flagged_roll(x, bump=True, timeout_s=TIMEOUT_S)
    # Typed as what it is, a value that differs along the axis.
    assert "x" in vma.varying_axes(rank), jax.typeof(rank)
    # One row per device: [the arm's rank, axis_index], broadcast over the
    # shard's rows so the output keeps x's layout.
    ranks = jnp.stack([rank, lax.axis_index("x")]).astype(x.dtype)
    return (out, jnp.broadcast_to(ranks[0], x.shape),
            jnp.broadcast_to(ranks[1], x.shape))

  x = _input(mesh, (5,))
  _, arm_rank, axis_index = _shard_map(mesh, body, 3)(x)
  arm_rank, axis_index = np.asarray(arm_rank), np.asarray(axis_index)
  np.testing.assert_array_equal(arm_rank, axis_index)
  # Not all one value: every rank of the axis appears.
  assert set(np.unique(arm_rank)) == set(range(4))
  _assert_idle("cpu")


@pytest.mark.parametrize("transport", ["rendezvous", None])
def test_flagged_reduce_scatter_reads_its_rank_from_the_arm(transport):
  """The flagged program takes the kernel's rank from the arm: no
  partition-id (and no fusion converting it) per call, on the rendezvous
  transport and on the push transport (None: the automatic choice of the
  flagged reduce-scatter), whose arm writes the rank too."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import functools  # pylint: disable=g-import-not-at-top
  import ficco_jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "cpu":
    # The kernel picks interpret mode from the default backend, and this
    # compiles the CPU program (it checks the program, not the GPU's).
    pytest.skip("needs CPU as the default backend")
  mesh = _mesh("cpu", "4")
  schedule = dataclasses.replace(
      schedule_lib.Schedule.from_short("direct/c1/dma/pallas/flagged"),
      transport=transport)
  op = functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                         schedule=schedule)
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, "x"), P("x")),
                            out_specs=P("x"), check_vma=False))
  a = jax.ShapeDtypeStruct((24, 40), jnp.float32,
                           sharding=NamedSharding(mesh, P(None, "x")))
  b = jax.ShapeDtypeStruct((40, 28), jnp.float32,
                           sharding=NamedSharding(mesh, P("x")))
  text = f.lower(a, b).compile().as_text()
  assert "partition-id" not in text
  # The program runs the transport asked for.
  assert ("ficco_push_start" in text) == (transport is None), transport
  assert ("ficco_flags_arm" in text) == (transport == "rendezvous"), transport


def test_flagged_start_times_out_on_a_flag_never_set():
  mesh = _mesh("cpu", "4")
  f = _shard_map(mesh, lambda x: (_flagged_roll(x, bump=False,
                                                timeout_s=0.5)[0],), 1)
  # The copy queue's wait for the flag or the sync's wait for the copies
  # times out first, whichever thread gets there.
  with pytest.raises(Exception, match="500 ms"):
    jax.block_until_ready(f(_input(mesh, (5,))))
  _assert_idle("cpu")


def test_flagged_start_needs_the_arms_landing_buffers():
  mesh = _mesh("cpu", "4")

  def body(x):
    plan = _roll_plan(x.shape[0])
    site = peer_copy.new_site()
    kw = dict(axis_name="x", site=site, op_name="test_flagged")
    flags, _, _ = peer_copy.arm(x, 1, plan, dtype=x.dtype,
                                row_shape=x.shape[1:], **kw)
    landing = peer_copy.start([x], plan, flags=flags + 1, landings=[x * 2],
                              flag_target=1, src_flags=(0,),
                              timeout_s=TIMEOUT_S, **kw)[0]
    del kw["site"]
    return (peer_copy.sync([(landing, site)], [([x, flags], site)],
                           timeout_s=TIMEOUT_S, **kw)[0],)

  with pytest.raises(Exception, match="differ from those ficco_flags_arm"):
    jax.block_until_ready(_shard_map(mesh, body, 1)(_input(mesh, (5,))))
  _assert_idle("cpu")
