"""One traced call site run several times at once in one execution.

A jitted function holding the op, called several times in one program, and
jax.checkpoint's recomputation under jax.grad both run one traced site
(one site id, one window) more than once per execution, in calls that XLA
may overlap (docs/protocol.md, "Several runs of one site"). Each transport
must compute every call right or refuse with the message that names the
cause, never mix the calls' data, crash or hang:

- rendezvous: pairs the devices' calls by start instruction on XLA:CPU and
  by order on GPUs, whose devices run a program in one order: always right.
- window: pairs by epoch (start order); right on GPUs; on XLA:CPU, whose
  devices may run independent calls in different orders, right or refused.
- push: runs a site's calls one at a time: right when XLA orders them one
  after the other (a data dependence between them does), else refused.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule

import util

pytestmark = pytest.mark.multigpu

TIMEOUT_S = 10.0
CALLS = 6  # Independent calls of one site in one program.
REFUSED = ("runs twice in this execution", "runs twice at once in this"
           " execution")


def _mesh(platform):
  return util.platform_mesh(platform, at_least=2)


def _layer(transport, platform):
  """A jitted layer holding one op call site, its operands' specs and
  whether the mesh program must skip the varying-axes check (Pallas
  interpreted off GPUs)."""
  if transport == "push":
    # The flagged reduce-scatter pushes (Pallas compute).
    s = Schedule(dataflow="direct", comm="dma", compute="pallas",
                 compute_granularity="flagged", transport="push")
    op, specs = ficco_jax.matmul_reduce_scatter, (P(None, "x"), P("x"), P("x"))
  else:
    s = Schedule(dataflow="direct", num_chunks=2, comm="dma",
                 transport=transport)
    op, specs = ficco_jax.all_gather_matmul, (P("x"), P(None, "x"),
                                              P(None, "x"))
  layer = jax.jit(functools.partial(op, axis_name="x", schedule=s,
                                    timeout_s=TIMEOUT_S))
  return layer, specs, transport == "push" and platform == "cpu"


def _put(mesh, spec, a):
  return jax.device_put(a, NamedSharding(mesh, spec))


def _right_or_refused(call, refs, refusable):
  """Runs ``call`` three times: every result within tolerance of its
  float64 reference, or (where ``refusable``) an error naming the cause.
  Returns whether it was refused."""
  for _ in range(3):
    t0 = time.monotonic()
    try:
      outs = jax.block_until_ready(call())
    except jax.errors.JaxRuntimeError as e:
      message = str(e)
      assert refusable and any(r in message for r in REFUSED), message
      # Refused by a check at the start, or by a peer's poisoned window:
      # never by the timeout.
      assert time.monotonic() - t0 < TIMEOUT_S, message
      print(f"refused: {message[:300]}")
      return True
    for out, ref in zip(outs, refs):
      assert util.rel_err(out, ref) < util.tol(np.float32)
  return False


def _after_refusal(platform, mesh, layer, specs, check_vma, x, w):
  """Fresh windows after jax.clear_caches(): one call per program works."""
  jax.clear_caches()
  f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs[:2],
                            out_specs=specs[2], check_vma=check_vma))
  out = f(_put(mesh, specs[0], x), _put(mesh, specs[1], w))
  assert util.rel_err(out, np.float64(x) @ np.float64(w)) < util.tol(
      np.float32)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("transport", ["rendezvous", "window", "push"])
def test_independent_calls_of_one_site(platform, transport):
  mesh = _mesh(platform)
  p = mesh.devices.size
  layer, specs, interpret = _layer(transport, platform)
  rng = np.random.default_rng(0)
  if transport == "push":
    xs = [rng.standard_normal((5 * p, 3 * p)).astype(np.float32)
          for _ in range(CALLS)]
    w = rng.standard_normal((3 * p, 7)).astype(np.float32)
  else:
    xs = [rng.standard_normal((6 * p, 9)).astype(np.float32)
          for _ in range(CALLS)]
    w = rng.standard_normal((9, 7 * p)).astype(np.float32)
  f = jax.jit(jax.shard_map(
      lambda xs, w: [layer(x, w) for x in xs], mesh=mesh,
      in_specs=([specs[0]] * CALLS, specs[1]), out_specs=[specs[2]] * CALLS,
      check_vma=not interpret))
  args = ([_put(mesh, specs[0], x) for x in xs], _put(mesh, specs[1], w))
  refs = [np.float64(x) @ np.float64(w) for x in xs]
  refusable = transport == "push" or (
      transport == "window" and platform == "cpu")
  if _right_or_refused(lambda: f(*args), refs, refusable):
    _after_refusal(platform, mesh, layer, specs, not interpret, xs[0], w)
  assert util.window_entries_after(platform) == 0
  assert util.library_entries_after(platform) == 0


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("transport", ["rendezvous", "window", "push"])
def test_calls_of_one_site_ordered_by_data_are_right(platform, transport):
  """Each call's input depends on the previous call's result, so XLA runs
  them one after the other: every transport, push included, is right."""
  mesh = _mesh(platform)
  p = mesh.devices.size
  layer, specs, interpret = _layer(transport, platform)
  rng = np.random.default_rng(2)
  shape = (5 * p, 3 * p) if transport == "push" else (6 * p, 9)
  x = rng.standard_normal(shape).astype(np.float32)
  w = rng.standard_normal((shape[1], 7 if transport == "push" else 7 * p)
                          ).astype(np.float32)

  def chain(x, w):
    outs = []
    for _ in range(CALLS):
      # A zero that XLA cannot fold away: the next call's input waits for
      # this call's result.
      outs.append(layer(x + 0 * jnp.sum(outs[-1]) if outs else x, w))
    return outs

  f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=specs[:2],
                            out_specs=[specs[2]] * CALLS,
                            check_vma=not interpret))
  args = (_put(mesh, specs[0], x), _put(mesh, specs[1], w))
  ref = np.float64(x) @ np.float64(w)
  for _ in range(3):
    for out in f(*args):
      assert util.rel_err(out, ref) < util.tol(np.float32)
  assert util.window_entries_after(platform) == 0
  assert util.library_entries_after(platform) == 0


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("transport", ["rendezvous", "window"])
def test_checkpoint_recomputes_a_site_under_grad(platform, transport):
  mesh = _mesh(platform)
  p = mesh.devices.size
  layer, specs, _ = _layer(transport, platform)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((6 * p, 9)).astype(np.float32)
  w = rng.standard_normal((9, 7 * p)).astype(np.float32)

  def loss(x, w):
    y = jax.shard_map(jax.checkpoint(layer), mesh=mesh, in_specs=specs[:2],
                      out_specs=specs[2])(x, w)
    return jnp.sum(jnp.sin(y))

  g = jax.jit(jax.grad(loss, argnums=(0, 1)))
  x64, w64 = np.float64(x), np.float64(w)
  c = np.cos(x64 @ w64)
  refs = (c @ w64.T, x64.T @ c)
  args = (_put(mesh, specs[0], x), _put(mesh, specs[1], w))
  refusable = transport == "window" and platform == "cpu"
  if _right_or_refused(lambda: g(*args), refs, refusable):
    _after_refusal(platform, mesh, layer, specs, True, x, w)
  assert util.window_entries_after(platform) == 0
  assert util.library_entries_after(platform) == 0
