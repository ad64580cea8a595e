"""The global-array form drops into a pjit-style model on a dp x tp mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
import util

pytestmark = pytest.mark.multigpu


def _mlp(x, w1, w2, *, mesh, schedule):
  # Sequence-parallel in, column-parallel up, row-parallel down, sequence-
  # parallel out: the Megatron-SP pattern with batch over "dp".
  h = ficco_jax.sharded.all_gather_matmul(x, w1, mesh=mesh, axis_name="tp",
                                          gather_axis=1, x_spec=P("dp", "tp"),
                                          schedule=schedule)
  h = jax.nn.gelu(h)
  return ficco_jax.sharded.matmul_reduce_scatter(h, w2, mesh=mesh,
                                                 axis_name="tp", scatter_axis=1,
                                                 h_spec=P("dp", None, "tp"),
                                                 schedule=schedule)


def _mlp_ref(x, w1, w2):
  return jax.nn.gelu(x @ w1) @ w2


@pytest.mark.parametrize("schedule", [
    None, Schedule(dataflow="bidirectional", num_chunks=2),
    Schedule(dataflow="direct", num_chunks=3, comm="dma")],
    ids=["default", "bidirectional/c2", "direct/c3/dma"])
def test_mlp_forward_and_grad_match_reference(schedule):
  mesh = util.mesh((2, 4), ("dp", "tp"))
  rng = np.random.default_rng(20)
  x = util.rand(rng, (4, 24, 16), np.float64)
  w1, w2 = util.rand(rng, (16, 40), np.float64), util.rand(rng, (40, 16), np.float64)
  x = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
  w1 = jax.device_put(w1, NamedSharding(mesh, P(None, "tp")))
  w2 = jax.device_put(w2, NamedSharding(mesh, P("tp", None)))

  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
  f = lambda *a: _mlp(*a, mesh=mesh, schedule=schedule)
  out = jax.jit(f)(x, w1, w2)
  assert tuple(out.sharding.spec)[:2] == ("dp", "tp")
  ref = _mlp_ref(*(np.asarray(a) for a in (x, w1, w2)))
  assert util.rel_err(out, ref) < util.tol(np.float64)

  grads = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x, w1, w2)
  ref_grads = jax.grad(loss(_mlp_ref), argnums=(0, 1, 2))(
      *(jnp.asarray(np.asarray(a)) for a in (x, w1, w2)))
  for g, r in zip(grads, ref_grads):
    assert util.rel_err(g, r) < util.tol(np.float64)


@pytest.mark.parametrize("comm", ["xla", "dma"])
def test_inside_scan(comm):
  """Layers in a scan: one call site runs many times per execution."""
  mesh = util.tp_mesh()
  rng = np.random.default_rng(21)
  layers = 3
  x = util.rand(rng, (24, 8), np.float64)
  ws = util.rand(rng, (layers, 8, 8), np.float64) / 3
  schedule = Schedule(dataflow="ring", num_chunks=2, comm=comm)

  def step(carry, w):
    y = ficco_jax.sharded.all_gather_matmul(carry, w, mesh=mesh, axis_name="x",
                                            schedule=schedule)
    # Back to row-sharded for the next layer (a cheap local slice).
    return jax.sharding.reshard(y, NamedSharding(mesh, P("x"))) if hasattr(
        jax.sharding, "reshard") else jax.reshard(y, NamedSharding(mesh, P("x"))), None

  out, _ = jax.jit(lambda x, ws: jax.lax.scan(step, x, ws))(
      jax.device_put(x, NamedSharding(mesh, P("x"))), ws)
  ref = x
  for i in range(layers):
    ref = ref @ ws[i]
  assert util.rel_err(out, ref) < util.tol(np.float64)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_pallas_schedules_run_through_the_sharded_forms(op):
  """The forms build their own shard_map, so off GPUs they must turn its
  varying-axes check off for Pallas's interpreter themselves (the error
  would tell the user to, who cannot)."""
  if util.on_gpu():
    pytest.skip("off GPUs only: on GPUs the check stays on (test_ops)")
  mesh = util.tp_mesh()
  p = mesh.devices.size
  rng = np.random.default_rng(21)
  sched = Schedule(dataflow="direct", comm="dma", compute="pallas",
                   compute_granularity="flagged")
  a = util.rand(rng, (6 * p, 10 * p), np.float32)
  w = util.rand(rng, (10 * p, 7 * p), np.float32)
  if op == "all_gather_matmul":
    a, w = a[:, :10], w[:10]
  out = jax.jit(lambda a, w: getattr(ficco_jax.sharded, op)(
      a, w, mesh=mesh, axis_name="x", schedule=sched))(a, w)
  assert util.rel_err(out, a.astype(np.float64) @ w) < util.tol(np.float32)
