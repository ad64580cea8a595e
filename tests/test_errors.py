"""Bad input gets a ValueError/TypeError naming the argument and the shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
import util


def _call(op, a_shape, w_shape, dtype=np.float32, in_specs=(P("x"), P(None, "x")),
          axis_name="x", **kw):
  mesh = util.mesh((4,), ("x",))
  f = jax.shard_map(functools.partial(op, axis_name=axis_name, **kw), mesh=mesh,
                    in_specs=in_specs, out_specs=P(), check_vma=False)
  a_spec = P(*list(in_specs[0])[:len(a_shape)])
  w_spec = P(*list(in_specs[1])[:len(w_shape)])
  jax.eval_shape(f, jax.ShapeDtypeStruct(a_shape, dtype,
                                         sharding=NamedSharding(mesh, a_spec)),
                 jax.ShapeDtypeStruct(w_shape, dtype,
                                      sharding=NamedSharding(mesh, w_spec)))


AG = ficco_jax.all_gather_matmul
RS = ficco_jax.matmul_reduce_scatter


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(a_shape=(24, 10), w_shape=(11, 8)), ValueError, r"w has shape \(11, 2\).*contraction size 10"),
    (dict(a_shape=(24,), w_shape=(10, 8), in_specs=(P("x"), P())), ValueError, r"x must have rank >= 2"),
    (dict(a_shape=(24, 10), w_shape=(10, 8, 1), in_specs=(P("x"), P())), ValueError, r"w must be a matrix"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), gather_axis=1), ValueError, r"gather_axis=1 is invalid.*\(6, 10\)"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), axis_name="y"), ValueError, r"axis 'y' is not bound"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), schedule=Schedule(dataflow="ring", num_chunks=4)), ValueError, r"x.shape\[0\].*\(6\) must be divisible by schedule.num_chunks \(4\)"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), schedule=Schedule(compute_granularity="halving")), ValueError, r"compute_granularity='halving' is the reduce-scatter's"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), schedule=Schedule(comm="dma", compute="pallas", compute_granularity="flagged", transport="push")), ValueError, r"compute='pallas' \(the signalled all-gather\) travels by transport='window'.*got transport='push'"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), schedule=Schedule(comm="dma", num_chunks=2, compute_granularity="flagged")), ValueError, r"all_gather_matmul's compute_granularity='flagged'.*num_chunks must be 1, got 2"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), schedule=Schedule(comm="dma", compute_granularity="flagged", transport="rendezvous")), ValueError, r"all_gather_matmul's compute_granularity='flagged' travels by transport='push'.*got transport='rendezvous'"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), dtype=np.int32), TypeError, r"x has dtype int32"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), schedule="direct"), TypeError, r"schedule must be a ficco_jax.Schedule"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), timeout_s=0), ValueError, r"timeout_s=0 must be a finite number of seconds"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), timeout_s=float("inf")), ValueError, r"timeout_s=inf must be a finite number of seconds"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), timeout_s=1e30), ValueError, r"timeout_s=1e\+30 must be a finite number of seconds in \(0, 604800\]"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), timeout_s="5"), TypeError, r"timeout_s must be a number of seconds, got '5' \(str\)"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), timeout_s=True), TypeError, r"timeout_s must be a number of seconds"),
    (dict(a_shape=(24, 0), w_shape=(0, 8)), ValueError, r"x has shape \(6, 0\): every dimension must be at least 1"),
    (dict(a_shape=(0, 10), w_shape=(10, 8)), ValueError, r"x has shape \(0, 10\): every dimension must be at least 1"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), preferred_element_type="foo"), TypeError, r"all_gather_matmul: preferred_element_type='foo' is not a dtype"),
    # Named before tracing, as the call's arguments, not a kernel's buffer.
    (dict(a_shape=(24, 10), w_shape=(10, 8), dtype=np.float64, schedule=Schedule(dataflow="ring", compute="pallas")), TypeError, r"all_gather_matmul: compute='pallas' takes bfloat16, float16 or float32 operands and results; x and w \(promoted together\) would be float64. Use Schedule\(compute='xla'\)"),
    (dict(a_shape=(24, 10), w_shape=(10, 8), preferred_element_type=np.float64, schedule=Schedule(comm="dma", compute="pallas", compute_granularity="flagged")), TypeError, r"the result \(preferred_element_type\) would be float64"),
])
def test_all_gather_matmul_errors(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _call(AG, **kwargs)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(a_shape=(22, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x"))), ValueError, r"h.shape\[0\] \(h is \(22, 5\)\) \(22\) must be divisible by the size of axis 'x' \(4\)"),
    (dict(a_shape=(24, 20), w_shape=(24, 3), in_specs=(P(None, "x"), P("x"))), ValueError, r"contraction size 5"),
    (dict(a_shape=(24, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x")), schedule=Schedule(dataflow="direct", num_chunks=4)), ValueError, r"must be divisible by schedule.num_chunks \(4\)"),
    (dict(a_shape=(24, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x")), scatter_axis=-1), ValueError, r"scatter_axis=-1 is invalid"),
    (dict(a_shape=(24, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x")), schedule=Schedule(comm="dma", compute="pallas", compute_granularity="flagged", transport="window")), ValueError, r"matmul_reduce_scatter's compute_granularity='flagged' travels by transport='push' or 'rendezvous'"),
    # Zero-size K or rows: the same clear error on every engine.
    (dict(a_shape=(24, 0), w_shape=(0, 3), in_specs=(P(None, "x"), P("x")), schedule=Schedule(dataflow="direct", comm="dma")), ValueError, r"h has shape \(24, 0\): every dimension must be at least 1"),
    (dict(a_shape=(0, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x")), schedule=Schedule(dataflow="direct", num_chunks=2, comm="dma")), ValueError, r"h has shape \(0, 5\): every dimension must be at least 1"),
    (dict(a_shape=(24, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x")), timeout_s=float("nan")), ValueError, r"timeout_s=nan must be a finite"),
    (dict(a_shape=(24, 20), w_shape=(20, 3), in_specs=(P(None, "x"), P("x")), dtype=np.float64, schedule=Schedule(dataflow="direct", comm="dma", compute="pallas")), TypeError, r"matmul_reduce_scatter: compute='pallas' takes .*; h and w \(promoted together\) would be float64"),
])
def test_matmul_reduce_scatter_errors(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _call(RS, **kwargs)


def test_outside_shard_map_explains_how_to_call():
  with pytest.raises(ValueError, match=r"inside jax.shard_map.*ficco_jax.sharded"):
    AG(jnp.ones((4, 3)), jnp.ones((3, 2)), axis_name="x")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(dataflow="spiral"), ValueError, r"dataflow='spiral' must be one of"),
    (dict(num_chunks=0), ValueError, r"num_chunks=0 must be >= 1"),
    (dict(num_chunks=2.0), TypeError, r"num_chunks=2.0 must be an int"),
    (dict(dataflow="none", num_chunks=2), ValueError, r"must be 1 with dataflow='none'"),
    (dict(comm="nccl"), ValueError, r"comm='nccl' must be one of"),
    (dict(compute="triton"), ValueError, r"compute='triton' must be one of"),
    (dict(num_sms=0), ValueError, r"num_sms=0 must be None or a positive int"),
    (dict(compute_granularity="tile"), ValueError,
     r"compute_granularity='tile' must be None or one of"),
    (dict(dataflow="ring", compute_granularity="halving"), ValueError,
     r"'halving' groups the peers of a direct step; it needs"
     r" dataflow='direct', got dataflow='ring'"),
    (dict(compute="pallas", reduce_in_epilogue=1), TypeError,
     r"reduce_in_epilogue=1 must be a bool"),
    (dict(reduce_in_epilogue=True), ValueError,
     r"reduce_in_epilogue=True needs dataflow='direct' and compute='pallas'"
     r".*compute='xla'"),
    (dict(dataflow="ring", compute="pallas", reduce_in_epilogue=True),
     ValueError, r"got dataflow='ring'"),
    (dict(comm="dma", transport="nvshmem"), ValueError,
     r"transport='nvshmem' must be None or one of"),
    (dict(transport="window"), ValueError,
     r"transport='window' applies to comm='dma' only, got comm='xla'"),
    (dict(comm="dma", transport="push"), ValueError,
     r"transport='push' needs compute_granularity='flagged'"),
    (dict(comm="dma", compute_granularity="flagged", transport="window"),
     ValueError, r"compute='xla' \(the push all-gather\) travels by"
     r" transport='push'"),
])
def test_schedule_validation(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    Schedule(**kwargs)


@pytest.mark.parametrize("schedule", [
    Schedule(), Schedule(dataflow="none"),
    Schedule(dataflow="ring", num_chunks=4, comm="dma", compute="pallas",
             num_sms=96),
    Schedule(dataflow="direct", num_chunks=2, comm="dma",
             compute_granularity="step"),
    Schedule(dataflow="direct", num_chunks=3, compute="pallas", num_sms=64,
             compute_granularity="piece"),
    Schedule(dataflow="direct", num_chunks=2, comm="dma", compute="pallas",
             compute_granularity="step", reduce_in_epilogue=True),
    Schedule(dataflow="direct", num_chunks=1, comm="dma", compute="pallas",
             compute_granularity="halving"),
    Schedule(dataflow="direct", num_chunks=2, comm="dma", compute="pallas",
             compute_granularity="flagged"),
    Schedule(dataflow="direct", num_chunks=2, comm="dma", compute="pallas",
             compute_granularity="flagged", transport="rendezvous"),
    Schedule(dataflow="ring", num_chunks=3, comm="dma", transport="window"),
    Schedule(dataflow="direct", num_chunks=1, comm="dma",
             compute_granularity="flagged", transport="push"),
])
def test_schedule_label_round_trips(schedule):
  assert Schedule.from_short(schedule.short()) == schedule


@pytest.mark.parametrize("label", ["direct/4", "direct/c2/dma/xla/fast",
                                   "ring/cx", "direct/c-1",
                                   "direct/c2/dma/pallas/piece/step",
                                   "direct/c2/dma/xla/flagged/push/window"])
def test_schedule_label_errors_name_the_label(label):
  with pytest.raises(ValueError, match="is not a schedule label"):
    Schedule.from_short(label)


def test_granularity_defaults_per_op():
  ag, rs = "all_gather_matmul", "matmul_reduce_scatter"
  assert Schedule().granularity(ag) == "step"
  assert Schedule(compute="pallas").granularity(ag) == "piece"
  assert Schedule().granularity(rs) == "piece"
  assert Schedule(compute_granularity="step").granularity(rs) == "step"


@pytest.mark.parametrize("peers, groups", [
    (1, (1,)), (2, (1, 1)), (3, (2, 1)), (5, (3, 1, 1)), (6, (3, 2, 1)),
    (7, (4, 2, 1))])
def test_peer_groups(peers, groups):
  rs = "matmul_reduce_scatter"
  assert ficco_jax.Schedule(compute_granularity="halving").peer_groups(
      rs, peers + 1) == groups
  assert Schedule().peer_groups(rs, peers + 1) == (1,) * peers
  assert Schedule(compute_granularity="step").peer_groups(
      rs, peers + 1) == (peers,)


@pytest.mark.parametrize("schedule, spans, want", [
    (Schedule(), False, None),
    (Schedule(comm="dma"), False, "rendezvous"),
    (Schedule(comm="dma"), True, "window"),
    (Schedule(comm="dma", transport="window"), False, "window"),
    (Schedule(comm="dma", compute="pallas", compute_granularity="flagged"),
     False, "push"),
    (Schedule(comm="dma", compute="pallas", compute_granularity="flagged"),
     True, "push"),
    (Schedule(comm="dma", compute="pallas", compute_granularity="flagged",
              transport="rendezvous"), False, "rendezvous"),
])
def test_transport_resolution(schedule, spans, want):
  assert schedule.resolved_transport(spans_processes=spans) == want


def test_rendezvous_across_processes_is_refused_naming_the_field():
  s = Schedule(comm="dma", transport="rendezvous")
  with pytest.raises(ValueError, match=r"Schedule\(transport='rendezvous'\)"
                     r".*spans processes"):
    s.resolved_transport(spans_processes=True)


def test_schedule_is_hashable_and_frozen():
  s = Schedule(dataflow="ring", num_chunks=2)
  assert {s: 1}[Schedule(dataflow="ring", num_chunks=2)] == 1
  with pytest.raises(Exception):
    s.num_chunks = 3  # type: ignore[misc]


def test_schedule_takes_numpy_ints_as_the_ints_they_are():
  s = Schedule(dataflow="ring", num_chunks=np.int64(2), comm="dma",
               compute="pallas", num_sms=np.int32(96))
  assert s == Schedule(dataflow="ring", num_chunks=2, comm="dma",
                       compute="pallas", num_sms=96)
  assert type(s.num_chunks) is int and type(s.num_sms) is int
  assert hash(s) == hash(Schedule.from_short(s.short()))
  with pytest.raises(TypeError, match=r"num_sms=96.0 must be None or a"
                     r" positive int"):
    Schedule(compute="pallas", num_sms=96.0)


# The global arrays the caller passed, each mistake named by the form itself
# (not the per-shard op's view, nor shard_map's message about its body).
@pytest.mark.parametrize("op, a, w, match", [
    ("all_gather_matmul", (12, 8), (9, 6),
     r"w has shape \(9, 6\): its first dimension must equal the contraction"
     r" size 8 \(x.shape\[-1\] of x \(12, 8\)\)"),
    ("all_gather_matmul", (10, 8), (8, 6),
     r"x.shape\[0\] \(x is \(10, 8\), split over 'x' by"
     r" x_spec=(?:P|PartitionSpec)\('x', None\)\) \(10\) must be divisible by"
     r" the devices along 'x' \(4\)"),
    ("all_gather_matmul", (12, 8), (8, 6),
     r"w.shape\[1\] \(w is \(8, 6\), its columns split over 'x'\) \(6\)"
     r" must be divisible by the size of axis 'x' \(4\)"),
    ("matmul_reduce_scatter", (12, 6), (6, 5),
     r"h.shape\[1\] \(h is \(12, 6\), split over 'x' by"
     r" h_spec=(?:P|PartitionSpec)\(None, 'x'\)\) \(6\) must be divisible"),
    ("matmul_reduce_scatter", (12, 8), (9, 5),
     r"w has shape \(9, 5\).*contraction size 8 \(h.shape\[-1\] of h"
     r" \(12, 8\)\)"),
])
def test_sharded_forms_name_the_global_arrays(op, a, w, match):
  mesh = util.mesh((4,), ("x",))
  fn = functools.partial(getattr(ficco_jax.sharded, op), mesh=mesh,
                         axis_name="x")
  with pytest.raises(ValueError, match=match):
    jax.jit(fn)(jnp.ones(a), jnp.ones(w))
  # And autotune, before it builds a key or compiles a candidate.
  with pytest.raises(ValueError, match=match):
    ficco_jax.autotune(op, jnp.ones(a), jnp.ones(w), mesh=mesh,
                       axis_name="x", store=False)


def test_sharded_spec_naming_no_mesh_axis_is_an_error():
  mesh = util.mesh((4,), ("x",))
  with pytest.raises(ValueError, match=r"x_spec=(?:P|PartitionSpec)\('dp', 'x', None\)"
                     r" names \['dp'\], not axes of the mesh"):
    ficco_jax.sharded.all_gather_matmul(
        jnp.ones((2, 8, 3)), jnp.ones((3, 4)), mesh=mesh, axis_name="x",
        gather_axis=1, x_spec=P("dp", "x"))


def test_sharded_rejects_unknown_axis():
  mesh = util.mesh((4,), ("x",))
  with pytest.raises(ValueError, match=r"axis_name 'tp' is not an axis of the mesh"):
    ficco_jax.sharded.all_gather_matmul(jnp.ones((8, 3)), jnp.ones((3, 4)),
                                        mesh=mesh, axis_name="tp")


def test_sharded_reduce_scatter_names_the_global_shape():
  mesh = util.mesh((4,), ("x",))
  with pytest.raises(ValueError, match=r"h.shape\[0\] \(h is \(50, 40\),"
                     r" the rows scattered\) \(50\) must be divisible by"
                     r" the size of axis 'x' \(4\)"):
    ficco_jax.sharded.matmul_reduce_scatter(jnp.ones((50, 40)),
                                            jnp.ones((40, 5)), mesh=mesh,
                                            axis_name="x")


@pytest.mark.parametrize("kw", [dict(dataflow="ring"), dict(comm="xla"),
                                dict(reduce_in_epilogue=True)])
def test_flagged_granularity_needs_direct_dma(kw):
  base = dict(dataflow="direct", comm="dma", compute="pallas",
              compute_granularity="flagged")
  with pytest.raises(ValueError, match="compute_granularity='flagged' needs"):
    Schedule(**{**base, **kw})


def test_flagged_reduce_scatter_needs_pallas():
  with pytest.raises(ValueError, match=r"matmul_reduce_scatter's"
                     r" compute_granularity='flagged' needs compute='pallas'"
                     r".*got compute='xla'"):
    _call(RS, a_shape=(24, 20), w_shape=(20, 3),
          in_specs=(P(None, "x"), P("x")),
          schedule=Schedule(comm="dma", compute_granularity="flagged"))


def _ag_args(mesh):
  rng = np.random.default_rng(0)
  x = util.put(mesh, P("x"), util.rand(rng, (24, 10), np.float32))
  w = util.put(mesh, P(None, "x"), util.rand(rng, (10, 28), np.float32))
  return x, w


def test_eager_copy_engine_call_is_one_clear_error():
  """Un-jitted shard_map (and the sharded form called eagerly) would run
  each copy-engine step as a program of its own: refused, naming jax.jit;
  comm="xla" runs eagerly."""
  mesh = util.mesh((4,), ("x",))
  x, w = _ag_args(mesh)
  dma = Schedule(dataflow="direct", num_chunks=2, comm="dma")

  def eager(schedule):
    return jax.shard_map(functools.partial(AG, axis_name="x",
                                           schedule=schedule),
                         mesh=mesh, in_specs=(P("x"), P(None, "x")),
                         out_specs=P(None, "x"))(x, w)

  with pytest.raises(ValueError, match=r"comm='dma' must be traced under"
                     r" jax.jit.*Schedule\(comm='xla'\)"):
    eager(dma)
  with pytest.raises(ValueError, match="must be traced under jax.jit"):
    ficco_jax.sharded.all_gather_matmul(x, w, mesh=mesh, axis_name="x",
                                        schedule=dma)
  ref = util.ref_all_gather_matmul(x, w)
  xla = Schedule(dataflow="direct", num_chunks=2)
  assert util.rel_err(eager(xla), ref) < util.tol(np.float32)
  assert util.rel_err(jax.jit(eager, static_argnums=0)(dma), ref) < util.tol(
      np.float32)


def test_autodiff_around_an_eager_copy_engine_call_is_the_same_error():
  """jax.grad of an eager shard_map wraps the operand in autodiff tracers
  (the ShardMapTracer inside): still the one clear error, not a protocol
  failure at run time; and under jax.vmap of jax.grad, the vmap error."""
  mesh = util.mesh((4,), ("x",))
  x, w = _ag_args(mesh)
  dma = Schedule(dataflow="direct", num_chunks=2, comm="dma")
  op = jax.shard_map(functools.partial(AG, axis_name="x", schedule=dma),
                     mesh=mesh, in_specs=(P("x"), P(None, "x")),
                     out_specs=P(None, "x"))
  loss = lambda x, w: jnp.sum(op(x, w) ** 2)  # noqa: E731
  with pytest.raises(ValueError, match="must be traced under jax.jit"):
    jax.grad(loss)(x, w)
  xs = util.put(mesh, P(None, "x"), np.stack([np.asarray(x)] * 3))
  with pytest.raises(NotImplementedError,
                     match="comm='dma' does not support jax.vmap"):
    jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(xs, w)
  # Under jit the same gradient runs.
  g = jax.jit(jax.grad(loss))(x, w)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = 2 * (x64 @ w64) @ w64.T  # d/dx of sum((x @ w) ** 2)
  assert util.rel_err(g, want) < util.tol(np.float32)


@pytest.mark.parametrize("where", ["inside_jit", "outside_jit"])
def test_vmap_of_a_copy_engine_op_is_one_clear_error(where):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(1)
  xs = util.put(mesh, P(None, "x"), util.rand(rng, (3, 24, 10), np.float32))
  w = util.put(mesh, P(None, "x"), util.rand(rng, (10, 28), np.float32))
  op = jax.shard_map(
      functools.partial(AG, axis_name="x",
                        schedule=Schedule(dataflow="ring", comm="dma")),
      mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
  f = (jax.jit(jax.vmap(op, in_axes=(0, None))) if where == "inside_jit"
       else jax.vmap(jax.jit(op), in_axes=(0, None)))
  with pytest.raises(NotImplementedError,
                     match="comm='dma' does not support jax.vmap"):
    f(xs, w)


@pytest.mark.skipif(util.on_gpu(), reason="the interpreter runs off GPUs only")
def test_pallas_interpreter_under_check_vma_says_how_to_run():
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(2)
  h, w = util.rand(rng, (48, 56), np.float32), util.rand(rng, (56, 8), np.float32)
  schedule = Schedule(dataflow="direct", num_chunks=3, comm="dma",
                      compute="pallas", reduce_in_epilogue=True)
  with pytest.raises(ValueError, match=r"Pallas's interpreter.*check_vma=False"):
    util.run_rs(mesh, h, w, schedule=schedule)  # check_vma=True: jax's default
  out = util.run_rs(mesh, h, w, schedule=schedule, check_vma=False)
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float32)
