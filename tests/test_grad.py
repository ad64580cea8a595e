"""jax.grad through both ops equals the float64 analytic gradient."""

import dataclasses
import functools
import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
import util

pytestmark = pytest.mark.multigpu

CASES = [Schedule(dataflow="none"),
         Schedule(dataflow="direct", num_chunks=3),
         Schedule(dataflow="ring", num_chunks=2),
         Schedule(dataflow="bidirectional", num_chunks=1),
         Schedule(dataflow="direct", num_chunks=2, comm="dma"),
         Schedule(dataflow="ring", num_chunks=1, comm="dma"),
         Schedule(dataflow="direct", num_chunks=2, comm="dma",
                  compute_granularity="step")]
# The push all-gather forward; its gradient's ops run "piece"
# (matmul.backward_static).
AG_CASES = CASES + [Schedule(dataflow="direct", num_chunks=1, comm="dma",
                             compute_granularity="flagged")]


def _loss(op, mesh, in_specs, out_spec, r, **kw):
  f = jax.shard_map(functools.partial(op, axis_name="x", **kw), mesh=mesh,
                    in_specs=in_specs, out_specs=out_spec)
  return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * r), argnums=(0, 1)))


@pytest.mark.parametrize("schedule", AG_CASES,
                         ids=[s.short() for s in AG_CASES])
def test_grad_all_gather_matmul(schedule):
  mesh = util.tp_mesh()
  rng = np.random.default_rng(10)
  x, w = util.rand(rng, (2, 24, 10), np.float64), util.rand(rng, (10, 28), np.float64)
  r = util.rand(rng, (2, 24, 28), np.float64)
  x_spec, w_spec = P(None, "x"), P(None, "x")
  grad = _loss(ficco_jax.all_gather_matmul, mesh, (x_spec, w_spec),
               P(None, None, "x"), r, gather_axis=1, schedule=schedule)
  dx, dw = grad(jax.device_put(x, NamedSharding(mesh, x_spec)),
                jax.device_put(w, NamedSharding(mesh, w_spec)))
  assert util.rel_err(dx, np.einsum("bmn,kn->bmk", r, w)) < util.tol(np.float64)
  assert util.rel_err(dw, np.einsum("bmk,bmn->kn", x, r)) < util.tol(np.float64)


# The reduce-scatter's halving granularity: its gradient's all-gather runs
# at the all-gather's default granularity (matmul.backward_static).
RS_CASES = CASES[:4] + CASES[-1:] + [
    Schedule(dataflow="direct", num_chunks=2, comm="dma",
             compute_granularity="halving")]


@pytest.mark.parametrize("schedule", RS_CASES, ids=[s.short() for s in RS_CASES])
def test_grad_matmul_reduce_scatter(schedule):
  mesh = util.tp_mesh()
  rng = np.random.default_rng(11)
  h, w = util.rand(rng, (2, 24, 20), np.float64), util.rand(rng, (20, 9), np.float64)
  r = util.rand(rng, (2, 24, 9), np.float64)
  h_spec, w_spec = P(None, None, "x"), P("x", None)
  grad = _loss(ficco_jax.matmul_reduce_scatter, mesh, (h_spec, w_spec),
               P(None, "x"), r, scatter_axis=1, schedule=schedule)
  dh, dw = grad(jax.device_put(h, NamedSharding(mesh, h_spec)),
                jax.device_put(w, NamedSharding(mesh, w_spec)))
  assert util.rel_err(dh, np.einsum("bmn,fn->bmf", r, w)) < util.tol(np.float64)
  assert util.rel_err(dw, np.einsum("bmf,bmn->fn", h, r)) < util.tol(np.float64)


def test_grad_bf16_keeps_dtypes():
  mesh = util.tp_mesh()
  rng = np.random.default_rng(12)
  x, w = util.rand(rng, (24, 16), jnp.bfloat16), util.rand(rng, (16, 8), jnp.bfloat16)
  r = util.rand(rng, (24, 8), jnp.bfloat16)
  grad = _loss(ficco_jax.all_gather_matmul, mesh, (P("x"), P(None, "x")),
               P(None, "x"), r, schedule=Schedule(dataflow="direct", num_chunks=2))
  dx, dw = grad(jax.device_put(x, NamedSharding(mesh, P("x"))),
                jax.device_put(w, NamedSharding(mesh, P(None, "x"))))
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  rf = np.asarray(r, np.float64)
  assert util.rel_err(dx, rf @ np.asarray(w, np.float64).T) < util.tol(jnp.bfloat16)
  assert util.rel_err(dw, np.asarray(x, np.float64).T @ rf) < util.tol(jnp.bfloat16)


def _lowered_count(fn, pattern: str, *args) -> int:
  """How often ``pattern`` occurs in ``jax.jit(fn)``'s lowering."""
  return len(re.findall(pattern, jax.jit(fn).lower(*args).as_text()))


def _permutes(fn, *args) -> int:
  return _lowered_count(fn, r"stablehlo\.collective_permute\b", *args)


def _copy_starts(fn, *args) -> int:
  # The copy engines' starts, one custom call per gather or scatter.
  return _lowered_count(fn, r"ficco_peer_copy_start", *args)


def _calls(fn, target, *args) -> int:
  return _lowered_count(fn, rf"custom_call @{target}\b", *args)


def _rand(mesh, rng, shape, spec):
  """Random float32 placed with ``spec`` on ``mesh``."""
  return jax.device_put(util.rand(rng, shape, np.float32),
                        NamedSharding(mesh, spec))


def _ag(mesh, schedule, check_vma=True):
  """The 2-D all-gather matmul over "x": x rows and w columns sharded."""
  return jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                        schedule=schedule),
      mesh=mesh, in_specs=(P("x", None), P(None, "x")),
      out_specs=P(None, "x"), check_vma=check_vma)


def _rs(mesh, schedule):
  """The 2-D reduce-scatter matmul over "x": h columns and w rows sharded."""
  return jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                        schedule=schedule),
      mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
      out_specs=P("x", None))


@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="direct", num_chunks=1),
    Schedule(dataflow="ring", num_chunks=2)], ids=lambda s: s.short())
def test_reduce_scatter_gradient_gathers_the_cotangent_once(schedule):
  # dh = all_gather(ct) @ w^T and dw = h^T @ all_gather(ct) share one
  # gather: the gradient moves what the forward reduce-scatter does plus one
  # all-gather of ct, not two.
  mesh = util.tp_mesh()
  rng = np.random.default_rng(14)
  h = _rand(mesh, rng, (24, 20), P(None, "x"))
  w = _rand(mesh, rng, (20, 9), P("x", None))
  ct = _rand(mesh, rng, (24, 9), P("x", None))
  rs, ag = _rs(mesh, schedule), _ag(mesh, schedule)
  # value_and_grad: the forward stays in the program next to the gradient.
  grad = jax.value_and_grad(lambda h, w: jnp.sum(rs(h, w) * ct),
                            argnums=(0, 1))
  forward = _permutes(rs, h, w)
  one_gather = _permutes(ag, ct, _rand(mesh, rng, (9, 20), P(None, "x")))
  assert forward > 0 and one_gather > 0
  assert _permutes(grad, h, w) == forward + one_gather


@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="direct", num_chunks=1),
    Schedule(dataflow="ring", num_chunks=2),
    Schedule(dataflow="direct", num_chunks=2, comm="dma",
             compute_granularity="step"),
    # The push all-gather: its call copies the landed shards out of the
    # window as the gathered x.
    Schedule(dataflow="direct", num_chunks=1, comm="dma",
             compute_granularity="flagged")], ids=lambda s: s.short())
def test_all_gather_gradient_keeps_the_gathered_x(schedule):
  # dw = all_gather(x)^T @ ct takes the x the forward gathered: the
  # gradient moves the forward's gather plus dx's reduce-scatter, no second
  # gather of x.
  mesh = util.tp_mesh()
  rng = np.random.default_rng(15)
  x = _rand(mesh, rng, (24, 20), P("x", None))
  w = _rand(mesh, rng, (20, 36), P(None, "x"))
  ct = _rand(mesh, rng, (24, 36), P(None, "x"))
  # dx's reduce-scatter runs the same dataflow, chunks and engine
  # (matmul.backward_static, for these schedules; the push all-gather's at
  # the default granularity).
  rs_schedule = (dataclasses.replace(schedule, compute_granularity=None)
                 if schedule.compute_granularity == "flagged" else schedule)
  ag, rs = _ag(mesh, schedule), _rs(mesh, rs_schedule)
  grad = jax.value_and_grad(lambda x, w: jnp.sum(ag(x, w) * ct),
                            argnums=(0, 1))
  copies = lambda f, *a: (_permutes(f, *a) + _copy_starts(f, *a)  # noqa: E731
                          + _calls(f, "ficco_push_gather", *a))
  forward = copies(ag, x, w)
  dx = copies(rs, ct, _rand(mesh, rng, (36, 20), P("x", None)))
  assert forward > 0 and dx > 0
  assert copies(grad, x, w) == forward + dx
  # And the values: dw from the kept x.
  _, (gx, gw) = jax.jit(grad)(x, w)
  xf, wf, cf = (np.asarray(a, np.float64) for a in (x, w, ct))
  assert util.rel_err(gw, xf.T @ cf) < util.tol(np.float32)
  assert util.rel_err(gx, cf @ wf.T) < util.tol(np.float32)


@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="direct", num_chunks=1, comm="dma", compute="pallas"),
    Schedule(dataflow="direct", num_chunks=2, comm="dma", compute="pallas",
             compute_granularity="step"),
    Schedule(dataflow="ring", num_chunks=1, compute="pallas"),
    # The signalled all-gather; its gradient's ops run "piece" (over the
    # transport a piece-wise op picks: rendezvous in one process).
    Schedule(dataflow="direct", num_chunks=2, comm="dma", compute="pallas",
             compute_granularity="flagged")],
    ids=lambda s: s.short())
def test_grad_all_gather_matmul_on_the_kernel(schedule):
  # The kernel writes the product in place; the gathered x the gradient
  # keeps comes from the same landed pieces. Off GPUs the kernel is Pallas's
  # interpreter, which needs check_vma=False.
  if util.on_gpu():
    pytest.skip("f32 at these sizes is the interpreter's case; the Hopper"
                " kernel takes bf16 at its tile multiples")
  mesh = util.tp_mesh()
  rng = np.random.default_rng(16)
  x = _rand(mesh, rng, (32, 64), P("x", None))
  w = _rand(mesh, rng, (64, 128), P(None, "x"))
  ct = _rand(mesh, rng, (32, 128), P(None, "x"))
  ag = _ag(mesh, schedule, check_vma=False)
  gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(ag(x, w) * ct),
                            argnums=(0, 1)))(x, w)
  xf, wf, cf = (np.asarray(a, np.float64) for a in (x, w, ct))
  assert util.rel_err(gw, xf.T @ cf) < util.tol(np.float32)
  assert util.rel_err(gx, cf @ wf.T) < util.tol(np.float32)


def test_a_gradient_that_keeps_only_the_gathered_x_still_ends_the_copies():
  # With dw alone asked for and the loss linear in the product, the primal
  # product is dead: the gathered x must still carry the invocation's end
  # (its done), or peers could read this device's shard after it is gone.
  mesh = util.tp_mesh()
  rng = np.random.default_rng(17)
  x = _rand(mesh, rng, (24, 20), P("x", None))
  w = _rand(mesh, rng, (20, 36), P(None, "x"))
  r = _rand(mesh, rng, (24, 36), P(None, "x"))
  ag = _ag(mesh, Schedule(dataflow="direct", num_chunks=2, comm="dma"))
  dw = jax.grad(lambda x, w: jnp.sum(ag(x, w) * r), argnums=1)
  # The forward alone: one start, its waits and its end.
  syncs = _calls(ag, "ficco_peer_copy_sync", x, w)
  assert _calls(dw, "ficco_peer_copy_start", x, w) == 1
  assert _calls(dw, "ficco_peer_copy_sync", x, w) == syncs
  xf, rf = np.asarray(x, np.float64), np.asarray(r, np.float64)
  assert util.rel_err(jax.jit(dw)(x, w), xf.T @ rf) < util.tol(np.float32)


@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="direct", num_chunks=1, comm="dma"),
    Schedule(dataflow="ring", num_chunks=1, comm="dma")],
    ids=lambda s: s.short())
def test_grad_under_scan_with_a_loop_invariant_gathered_operand(schedule):
  # x is the same in every iteration (a cross-attention input, say), w is
  # scanned: JAX's scan hoists what depends on x alone out of the loop, and
  # a copy start must not leave its waits behind in the loop.
  mesh = util.tp_mesh()
  rng = np.random.default_rng(18)
  x = _rand(mesh, rng, (3, 24, 20), P(None, "x"))
  ws = _rand(mesh, rng, (2, 20, 36), P(None, None, "x"))
  op = functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                         schedule=schedule, gather_axis=1)

  def f(a, ws):
    def body(c, wl):
      return c, jnp.sum(op(a, wl) ** 2)
    return lax.psum(lax.scan(body, jnp.zeros(()), ws)[1].sum(), "x")

  sm = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "x"), P(None, None, "x")),
                     out_specs=P())
  gx, gws = jax.jit(jax.grad(sm, argnums=(0, 1)))(x, ws)
  xf, wf = np.asarray(x, np.float64), np.asarray(ws, np.float64)
  y = [np.einsum("bmk,kn->bmn", xf, wf[l]) for l in range(2)]
  want_w = np.stack([2 * np.einsum("bmk,bmn->kn", xf, y[l])
                     for l in range(2)])
  want_x = sum(2 * np.einsum("bmn,kn->bmk", y[l], wf[l]) for l in range(2))
  assert util.rel_err(gws, want_w) < util.tol(np.float32)
  assert util.rel_err(gx, want_x) < util.tol(np.float32)


def test_a_reduce_scatter_gradient_without_dh_still_ends_its_gather():
  # dw alone: dh, the product of the cotangent's gather, is dead, and the
  # gathered cotangent must still carry that gather's end.
  mesh = util.tp_mesh()
  rng = np.random.default_rng(19)
  sched = Schedule(dataflow="direct", num_chunks=2, comm="dma")
  h = _rand(mesh, rng, (24, 20), P(None, "x"))
  w = _rand(mesh, rng, (20, 9), P("x", None))
  r = _rand(mesh, rng, (24, 9), P("x", None))
  rs, ag = _rs(mesh, sched), _ag(mesh, sched)
  dw = jax.grad(lambda h, w: jnp.sum(rs(h, w) * r), argnums=1)
  # The cotangent's gather alone: one start, its waits and its end.
  wt = _rand(mesh, rng, (9, 20), P(None, "x"))
  assert _calls(dw, "ficco_peer_copy_start", h, w) == 1
  assert (_calls(dw, "ficco_peer_copy_sync", h, w)
          == _calls(ag, "ficco_peer_copy_sync", r, wt))
  hf, rf = np.asarray(h, np.float64), np.asarray(r, np.float64)
  assert util.rel_err(jax.jit(dw)(h, w), hf.T @ rf) < util.tol(np.float32)
