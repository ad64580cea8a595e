"""Ordering races between a copy-engine start and the sync that ends it.

XLA orders custom calls by data alone, and XLA:CPU's thunk executor runs
whatever is ready at once (an optimization barrier orders nothing once it
is compiled away). A sync that ends an invocation (its done) finds it
through what the start registered on the same device, so the sync must
read a buffer computed from that start's outputs. A done that is not
ordered so may run first: its device fails with "no pending start of this
execution has keepalive[0] as sources[0]" and its peers wait out
``timeout_s``, in some calls or in every one, depending on how the
executor's threads interleave. The reduce-scatter's ``reduce_in_epilogue``
schedules with several chunks are where this shows: their last sync ends
every chunk's invocations, and must keep each earlier chunk's waited
landing buffer alive, not only its sources.

`test_every_done_reads_its_start` checks the ordering in the traced program
of every copy-engine schedule, forward and backward, so it does not depend
on timing; `test_epilogue_reduce_scatter_survives_repeated_calls` runs the
schedules where the race appeared, many times.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src import schedule as schedule_lib
import util

pytestmark = pytest.mark.multigpu

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
_START, _SYNC = "ficco_peer_copy_start", "ficco_peer_copy_sync"


def _sub_jaxprs(params):
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jcore.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jcore.Jaxpr):
        yield v


def _is_ref(v):
  return (not isinstance(v, jcore.Literal)
          and hasattr(getattr(v, "aval", None), "inner_aval"))


def _starts_read(jaxpr, in_sites, unordered):
  """The start sites each output of ``jaxpr`` is computed from, given those
  of its inputs; appends to ``unordered`` the (site, op) of every done whose
  sync reads nothing computed from that site's start.

  An optimization barrier passes each operand to its own result only: it
  ties values together in the schedule XLA plans, but XLA:CPU runs the
  compiled program without it. Nested jaxprs (shard_map, custom_vjp, scan,
  pallas_call) see every input of their equation. An equation that takes a
  mutable ref may write it (the Hopper kernel writes ``out`` in place
  through one, and ``jax.freeze`` reads it after): the ref then carries
  everything the equation read, as the aliased buffer does once lowered.
  """
  sites = dict(zip(jaxpr.invars, in_sites))
  read = lambda v: (frozenset() if isinstance(v, jcore.Literal)
                    else sites.get(v, frozenset()))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    every = frozenset().union(*ins)
    if eqn.primitive.name == "optimization_barrier":
      outs = ins
    else:
      inner = frozenset()
      for sub in _sub_jaxprs(eqn.params):
        inner = inner.union(
            *_starts_read(sub, [every] * len(sub.invars), unordered))
      if eqn.primitive.name == _START:
        inner |= {eqn.params["site"]}
      if eqn.primitive.name == _SYNC:
        unordered += [(s, eqn.params["op_name"])
                      for s in eqn.params["done_sites"] if s not in every]
      outs = [every | inner] * len(eqn.outvars)
      for v in eqn.invars:
        if _is_ref(v):
          sites[v] = every | inner
    sites.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _unordered_dones(fn, *args):
  unordered = []
  closed = jax.make_jaxpr(fn)(*args)
  _starts_read(closed.jaxpr, [frozenset()] * len(closed.jaxpr.invars),
               unordered)
  return unordered


def _dma_schedules(op):
  """Every copy-engine schedule of ``op`` at 1 and 3 chunks (2 orders
  nothing that 3 does not)."""
  granularities = (None, *schedule_lib.GRANULARITIES)
  for dataflow, chunks, compute, granularity, epilogue in itertools.product(
      ("direct", "ring", "bidirectional"), (1, 3), ("xla", "pallas"),
      granularities, (False, True)):
    if op == AG and (epilogue or granularity == "halving" or (
        granularity == "flagged" and (compute != "xla" or chunks != 1
                                      or dataflow != "direct"))):
      continue
    if op != AG and granularity == "flagged" and compute != "pallas":
      continue  # The reduce-scatter's flagged kernel is ficco's.
    # The flagged reduce-scatter picks its transport when traced.
    transports = ((None, "rendezvous") if granularity == "flagged" and op != AG
                  else (None,))
    for transport in transports:
      try:
        yield Schedule(dataflow=dataflow, num_chunks=chunks, comm="dma",
                       compute=compute, compute_granularity=granularity,
                       reduce_in_epilogue=epilogue, transport=transport)
      except ValueError:
        continue  # Not a point of the design space.


def _sizes(op, p):
  """(dtype, global shapes of the operands, specs, output spec); on GPUs
  whole Hopper tiles (768 rows: 3 chunks of 256), as in test_ops."""
  dtype, m, k, n = ((jnp.bfloat16, 768, 256, 128) if util.on_gpu()
                    else (np.float32, 6, 10, 7))
  if op == AG:
    return (dtype, ((p * m, k), (k, p * n)), (P("x"), P(None, "x")),
            P(None, "x"))
  return (dtype, ((p * m, p * n), (p * n, k)), (P(None, "x"), P("x")),
          P("x"))


@pytest.mark.parametrize("op", [AG, RS])
def test_every_done_reads_its_start(op):
  mesh = util.tp_mesh()
  p = mesh.devices.size
  dtype, shapes, specs, out_spec = _sizes(op, p)
  args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec))
          for s, spec in zip(shapes, specs)]
  checked, unordered = [], {}
  for schedule in _dma_schedules(op):
    f = jax.shard_map(
        functools.partial(getattr(ficco_jax, op), axis_name="x",
                          schedule=schedule),
        mesh=mesh, in_specs=specs, out_specs=out_spec,
        check_vma=util.on_gpu() or schedule.compute != "pallas")
    grad = jax.grad(lambda a, b, f=f: f(a, b).astype(jnp.float32).sum(),
                    argnums=(0, 1))
    found = _unordered_dones(f, *args) + _unordered_dones(grad, *args)
    if found:
      unordered[schedule.short()] = sorted(set(found))
    checked.append(schedule.short())
  # The schedules where the race showed are among those checked.
  assert op == AG or {"direct/c3/dma/pallas/epi",
                      "direct/c3/dma/pallas/step/epi"} <= set(checked)
  assert not unordered, (
      "dones not ordered after their starts by data (site, op):"
      f" {unordered}")


def test_the_order_check_sees_a_done_before_its_start():
  """The check itself: a sync that ends an invocation while reading only its
  sources (the start's operand, not its outputs) is reported."""
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.ops.matmul_reduce_scatter import pieces  # pylint: disable=g-import-not-at-top

  mesh = util.tp_mesh()
  p = mesh.devices.size
  kw = dict(axis_name="x", op_name="order_check", timeout_s=1.0)

  def body(x, ordered):
    plan = pieces.group_plan(p, x.shape[0], (1,))  # Pull from rank r - 1.
    site = peer_copy.new_site()
    landings = peer_copy.start([x], plan, site=site, **kw)
    if ordered:
      return peer_copy.sync([(b, site) for b in landings], [([x], site)],
                            **kw)[0]
    x, landings = jax.lax.optimization_barrier((x, landings))
    done = peer_copy.sync([], [([x], site)], out=x, **kw)[0]
    waited = peer_copy.sync([(b, site) for b in landings], [], **kw)[0]
    return done + waited.sum()

  def through_ref(x, ordered):
    # As the Hopper kernel's in-place write: the done's operand is a frozen
    # ref that an equation reading the landing buffer wrote.
    plan = pieces.group_plan(p, x.shape[0], (1,))
    site = peer_copy.new_site()
    landings = peer_copy.start([x], plan, site=site, **kw)
    (waited,) = peer_copy.sync([(b, site) for b in landings], [], **kw)
    ref = jax.new_ref(jnp.zeros_like(x))
    if ordered:
      ref[...] = waited
    out = jax.freeze(ref)
    return peer_copy.sync([], [([x], site)], out=out + x, **kw)[0]

  x = jax.ShapeDtypeStruct((p * 8, 4), np.float32,
                           sharding=NamedSharding(mesh, P("x")))
  for fn in (body, through_ref):
    for ordered in (True, False):
      f = jax.shard_map(functools.partial(fn, ordered=ordered), mesh=mesh,
                        in_specs=P("x"), out_specs=P("x"), check_vma=False)
      found = _unordered_dones(f, x)
      assert bool(found) != ordered, (fn.__name__, ordered, found)


def _epilogue_program(mesh, chunks, transport):
  schedule = Schedule(dataflow="direct", num_chunks=chunks, comm="dma",
                      compute="pallas", reduce_in_epilogue=True,
                      transport=transport)
  return jax.jit(jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                        schedule=schedule, timeout_s=5.0),
      mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x"),
      check_vma=util.on_gpu()))


def test_epilogue_reduce_scatter_survives_repeated_calls():
  """The reported loop: the epilogue reduce-scatter at several chunk counts,
  axis sizes (rows per chunk not a power of two on CPU) and both
  one-process transports, each program jitted once, called again and again
  on fresh data, the programs interleaved and some calls dispatched
  back-to-back. With a last sync that keeps only the earlier chunks'
  sources alive, every call at c3/P=4 and c6/P=2 fails on a 2-core host."""
  devices = util.test_devices()
  gpu = util.on_gpu()
  # (axis size, chunks), where there are devices enough.
  configs = [(p, c) for p, c in ((4, 3), (2, 6), (8, 2)) if p <= len(devices)]
  programs = []
  for p, chunks in configs:
    mesh = jax.make_mesh((p,), ("x",), devices=devices[:p])
    for transport in ("rendezvous", "window"):
      programs.append((mesh, _epilogue_program(mesh, chunks, transport),
                       f"P={p} c{chunks} {transport}"))
  dtype, m, k, n = ((jnp.bfloat16, 1536, 256, 128) if gpu
                    else (np.float32, 18, 11, 5))
  rng = np.random.default_rng(0)
  rounds, burst = 6, 3
  for _ in range(rounds):
    for mesh, f, label in programs:
      p = mesh.devices.size
      calls = []
      # A few calls in flight per program: each is checked once all are
      # dispatched (far below the queue depth at which XLA:CPU stalls).
      for _ in range(burst):
        h = util.rand(rng, (p * m, p * n), dtype)
        w = util.rand(rng, (p * n, k), dtype)
        out = f(util.put(mesh, P(None, "x"), h), util.put(mesh, P("x"), w))
        calls.append((out, h, w))
      for out, h, w in calls:
        err = util.rel_err(out, util.ref_matmul_reduce_scatter(h, w))
        assert err < util.tol(dtype), (label, err)
  platform = util.platform_name()
  assert util.library_entries_after(platform) == 0
  assert util.window_entries_after(platform) == 0


def test_independent_chains_of_one_program_never_stall_each_other():
  """A bidirectional two-chunk reduce-scatter runs four independent chains
  of ring hops. XLA:CPU starts independent ops in the order they become
  ready, which differs between devices; with one FIFO copy queue per device
  a flag wait of one chain held back the copies of another that the peer it
  waited for needed first, and the call stalled until its timeout (about 1
  in 50 fresh programs on 4 CPU devices; this loop caught it about half the
  time). Each window now has its own lane on a queue. On GPUs a program
  runs in one order everywhere; the loop runs there too."""
  mesh = util.tp_mesh()
  p = mesh.devices.size
  schedule = Schedule(dataflow="bidirectional", num_chunks=2, comm="dma",
                      transport="window")
  rng = np.random.default_rng(3)
  m, k, n = 6, 10, 7
  for _ in range(25):
    # A fresh program each time: the devices' orders are decided anew.
    f = jax.jit(jax.shard_map(
        functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                          schedule=schedule, timeout_s=10.0),
        mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x")))
    for _ in range(2):  # The second call reuses the windows' next slots.
      h = util.rand(rng, (p * m, p * n), np.float32)
      w = util.rand(rng, (p * n, k), np.float32)
      out = f(util.put(mesh, P(None, "x"), h),
              util.put(mesh, P("x", None), w))
      assert util.rel_err(out, util.ref_matmul_reduce_scatter(
          h, w)) < util.tol(np.float32)


@pytest.mark.parametrize("transport", [None, "window"])
def test_every_done_of_the_moe_layer_reads_its_start(transport):
  """The MoE dispatch and combine on the copy engines, forward and grad."""
  mesh = util.tp_mesh()
  p, t, d, f, e_local = mesh.devices.size, 12, 8, 6, 2
  schedule = Schedule(dataflow="direct", comm="dma", transport=transport)

  def layer(x, w1, w2, gs):
    h = ficco_jax.all_to_all_matmul(x, w1, gs[0], axis_name="x",
                                    schedule=schedule)
    return ficco_jax.matmul_all_to_all(jax.nn.relu(h), w2, gs[0],
                                       axis_name="x", num_tokens=t,
                                       schedule=schedule)
  spec = P("x")
  fn = jax.shard_map(layer, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
  shapes = [((p * t, d), jnp.float32), ((p * e_local, d, f), jnp.float32),
            ((p * e_local, f, d), jnp.float32), ((p, p * e_local), jnp.int32)]
  args = [jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, spec))
          for s, dt in shapes]
  grad = jax.grad(lambda x, w1, w2, gs: fn(x, w1, w2, gs).sum(),
                  argnums=(0, 1, 2))
  found = _unordered_dones(fn, *args) + _unordered_dones(grad, *args)
  assert not found, f"dones not ordered after their starts: {found}"
