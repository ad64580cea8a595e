"""The MoE ops (`all_to_all_matmul`, `matmul_all_to_all`) against a
per-token reference, across routings, schedules, dtypes and axis sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule

import util

pytestmark = pytest.mark.multigpu

T, D, F = 13, 6, 5  # tokens per device, model and expert widths
SCHEDULES = [None, Schedule(dataflow="none"), Schedule(dataflow="direct")]
sched_id = lambda s: s.short() if s is not None else "default"


def _routing(rng, kind, p, e_local):
  """group_sizes [P devices, P * E_l experts] with row sums <= T."""
  e = p * e_local
  if kind == "random":
    gs = rng.multinomial(T - 2, np.ones(e) / e, size=p)
  elif kind == "empty_experts":  # most experts get nothing
    gs = np.zeros((p, e), np.int64)
    gs[:, ::3] = rng.multinomial(T, np.ones(len(range(0, e, 3))) /
                                 len(range(0, e, 3)), size=p)
  elif kind == "one_device":  # every token to device 1's experts
    gs = np.zeros((p, e), np.int64)
    gs[:, e_local:2 * e_local] = rng.multinomial(
        T, np.ones(e_local) / e_local, size=p)
  elif kind == "skewed":  # Zipf-like expert load
    weights = 1.0 / np.arange(1, e + 1) ** 1.2
    gs = rng.multinomial(T, weights / weights.sum(), size=p)
  else:
    raise ValueError(kind)
  return gs.astype(np.int32)


def _expert_of_rows(gs_row, t):
  """Global expert of each token row (-1 past the routed rows)."""
  ends = np.cumsum(gs_row)
  ids = np.searchsorted(ends, np.arange(t), side="right")
  return np.where(np.arange(t) < ends[-1], ids, -1)


def _ref_layer(x, w1, w2, gs):
  """float64 per-token MoE: relu(x @ W1[e]) @ W2[e] per routed row."""
  x = np.asarray(x, np.float64).reshape(gs.shape[0], T, D)
  w1 = np.asarray(w1, np.float64)
  w2 = np.asarray(w2, np.float64)
  y = np.zeros((gs.shape[0], T, w2.shape[-1]))
  for s in range(gs.shape[0]):
    for i, e in enumerate(_expert_of_rows(gs[s], T)):
      if e >= 0:
        y[s, i] = np.maximum(x[s, i] @ w1[e], 0) @ w2[e]
  return y.reshape(-1, w2.shape[-1])


def _layer(mesh, schedule, capacity):
  def f(x, w1, w2, gs):
    gs = gs[0]
    h = ficco_jax.all_to_all_matmul(x, w1, gs, axis_name="ep",
                                    capacity=capacity, schedule=schedule)
    h = jax.nn.relu(h).astype(x.dtype)
    return ficco_jax.matmul_all_to_all(h, w2, gs, axis_name="ep",
                                       num_tokens=x.shape[0],
                                       schedule=schedule)
  return jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P("ep")),
      out_specs=P("ep")))


def _inputs(mesh, rng, kind, e_local, dtype):
  p = mesh.devices.size
  x = util.rand(rng, (p * T, D), dtype)
  w1 = util.rand(rng, (p * e_local, D, F), dtype)
  w2 = util.rand(rng, (p * e_local, F, D), dtype)
  gs = _routing(rng, kind, p, e_local)
  put = lambda a: util.put(mesh, P("ep"), a)
  return (put(x), put(w1), put(w2), put(gs)), (x, w1, w2, gs)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "empty_experts", "one_device",
                                  "skewed"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=sched_id)
def test_layer_matches_the_per_token_reference(p, kind, schedule):
  mesh = util.mesh((p,), ("ep",))
  rng = np.random.default_rng(p * 100 + len(kind))
  args, host = _inputs(mesh, rng, kind, {2: 4, 4: 3, 8: 1}[p], np.float32)
  out = _layer(mesh, schedule, None)(*args)
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(np.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float64])
def test_layer_dtypes_and_a_tight_capacity(dtype):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(7)
  args, host = _inputs(mesh, rng, "random", 2, dtype)
  gs = host[3]
  p = mesh.devices.size
  # Exactly the most rows any device receives: nothing to spare.
  need = max(gs[:, r * 2:(r + 1) * 2].sum() for r in range(p))
  out = _layer(mesh, Schedule(dataflow="direct"), int(need))(*args)
  assert out.dtype == dtype
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(dtype)


def test_dispatch_layout_is_source_major_by_expert():
  mesh = util.tp_mesh(4, "ep")
  p, e_local = mesh.devices.size, 2
  rng = np.random.default_rng(3)
  args, (x, w1, _, gs) = _inputs(mesh, rng, "random", e_local, np.float32)
  cap = p * T

  def f(x, w, gs):
    return ficco_jax.all_to_all_matmul(x, w, gs[0], axis_name="ep",
                                       schedule=Schedule(dataflow="direct"))
  out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=P("ep")))(args[0], args[1], args[3])
  out = np.asarray(out).reshape(p, cap, F)
  xs = np.asarray(x, np.float64).reshape(p, T, D)
  for r in range(p):
    rows = []
    for s in range(p):
      starts = np.concatenate([[0], np.cumsum(gs[s])])
      for j in range(e_local):
        e = r * e_local + j
        seg = xs[s, starts[e]:starts[e + 1]]
        rows.extend(seg @ np.asarray(w1[e], np.float64))
    ref = np.zeros((cap, F))
    ref[:len(rows)] = rows
    assert util.rel_err(out[r], ref) < util.tol(np.float32), r


@pytest.mark.parametrize("schedule", SCHEDULES[1:], ids=sched_id)
def test_gradients_match_the_reference(schedule):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(11)
  args, host = _inputs(mesh, rng, "skewed", 2, np.float32)
  gs = host[3]
  layer = _layer(mesh, schedule, None)
  ct = rng.standard_normal((mesh.devices.size * T, D)).astype(np.float32)
  ct_sharded = util.put(mesh, P("ep"), ct)
  loss = lambda x, w1, w2: jnp.sum(layer(x, w1, w2, args[3]) * ct_sharded)
  with jax.set_mesh(mesh):  # The mesh's axes may be explicit.
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3])

  expert = np.concatenate([_expert_of_rows(g, T) for g in gs])
  def ref_loss(x, w1, w2):
    safe = np.maximum(expert, 0)
    h = jax.nn.relu(jnp.einsum("td,tdf->tf", x, w1[safe]))
    y = jnp.einsum("tf,tfd->td", h, w2[safe])
    return jnp.vdot(jnp.where((expert >= 0)[:, None], y, 0), ct)
  want = jax.grad(ref_loss, argnums=(0, 1, 2))(*(jnp.asarray(a) for a in
                                                 host[:3]))
  for name, g, r in zip(("x", "w1", "w2"), got, want):
    assert util.rel_err(g, r) < util.tol(np.float32), name


@pytest.mark.parametrize("schedule", SCHEDULES[1:], ids=sched_id)
def test_capacity_overflow_is_an_error_naming_the_device(schedule):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(5)
  args, host = _inputs(mesh, rng, "one_device", 1, np.float32)
  with pytest.raises(Exception, match=r"on device 1 of axis 'ep', the routing"
                     r" sends \d+ rows, more than capacity=4"):
    jax.block_until_ready(_layer(mesh, schedule, 4)(*args))
  # The next call, with room, works.
  out = _layer(mesh, schedule, mesh.devices.size * T)(*args)
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(np.float32)


@pytest.mark.parametrize("schedule", SCHEDULES[1:], ids=sched_id)
def test_capacity_below_the_tokens_per_device(schedule):
  # Pieces of min(T, C) = C rows: each peer sends at most C to any device.
  mesh = util.tp_mesh(4, "ep")
  p = mesh.devices.size
  rng = np.random.default_rng(17)
  args, host = _inputs(mesh, rng, "random", 2, np.float32)
  # Every device routes one row to each expert, or none: a device receives
  # at most 2 * P <= 8 rows, fewer than its T = 13 tokens.
  gs = rng.integers(0, 2, size=(p, 2 * p)).astype(np.int32)
  need = max(gs[:, r * 2:(r + 1) * 2].sum() for r in range(p))
  out = _layer(mesh, schedule, int(need))(*args[:3], util.put(mesh, P("ep"), gs))
  assert need < T
  assert util.rel_err(out, _ref_layer(*host[:3], gs)) < util.tol(np.float32)


@pytest.mark.parametrize("counts, match", [
    ("negative", r"group_sizes has a negative count \(-1\)"),
    ("too_many", r"group_sizes routes 14 rows, more than the 13 token rows"),
])
def test_invalid_counts_are_an_error_not_wrong_rows(counts, match):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(19)
  args, host = _inputs(mesh, rng, "random", 1, np.float32)
  gs = np.array(host[3])
  if counts == "negative":
    gs[1, 0] = -1
  else:
    gs[1, 0] += T + 1 - gs[1].sum()
  bad = util.put(mesh, P("ep"), gs)
  with pytest.raises(Exception, match="on device 1 of axis 'ep', " + match):
    jax.block_until_ready(_layer(mesh, None, None)(*args[:3], bad))


def test_preferred_element_type_gives_f32_from_bf16():
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(23)
  args, host = _inputs(mesh, rng, "random", 2, jnp.bfloat16)

  def f(x, w, gs):
    return ficco_jax.all_to_all_matmul(
        x, w, gs[0], axis_name="ep", schedule=Schedule(dataflow="direct"),
        preferred_element_type=jnp.float32)
  out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=P("ep")))(args[0], args[1], args[3])
  assert out.dtype == jnp.float32


@pytest.mark.parametrize("bad, match", [
    (dict(x=np.zeros((2, 3, 6), np.float32)), r"x must be \[tokens, d\]"),
    (dict(w=np.zeros((2, 7, 5), np.float32)), r"w must be \[local experts, d, f\]"),
    (dict(gs=np.zeros((3,), np.int32)), r"group_sizes has shape \(3,\)"),
    (dict(gs=np.zeros((8,), np.float32)), r"group_sizes must be a 1-D integer"),
    (dict(capacity=0), r"capacity=0 must be a positive int"),
    (dict(capacity=2.0), r"capacity=2.0 must be an int"),
    (dict(preferred=np.int32), r"preferred_element_type=int32 must be a floating"),
    (dict(schedule=Schedule(dataflow="ring")), r"dataflow='ring'"),
    (dict(schedule=Schedule(dataflow="direct", num_chunks=2)),
     r"num_chunks=2\) is not supported by the MoE ops yet"),
])
def test_bad_arguments_name_what_was_expected(bad, match):
  mesh = util.mesh((4,), ("ep",))
  x = bad.get("x", np.zeros((T, D), np.float32))
  w = bad.get("w", np.zeros((2, D, F), np.float32))
  gs = bad.get("gs", np.zeros((8,), np.int32))

  def f(x, w, gs):
    return ficco_jax.all_to_all_matmul(
        x, w, gs, axis_name="ep", capacity=bad.get("capacity"),
        schedule=bad.get("schedule"),
        preferred_element_type=bad.get("preferred"))
  with pytest.raises((TypeError, ValueError), match=match):
    jax.shard_map(f, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                  check_vma=False)(x, w, gs)


def test_sharded_forms_match_the_per_shard_layer():
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(13)
  args, host = _inputs(mesh, rng, "random", 2, np.float32)
  x, w1, w2, gs = args
  sched = Schedule(dataflow="direct")

  @jax.jit
  def layer(x, w1, w2, gs):
    h = ficco_jax.sharded.all_to_all_matmul(x, w1, gs, mesh=mesh,
                                            axis_name="ep", schedule=sched)
    h = jax.nn.relu(h)
    return ficco_jax.sharded.matmul_all_to_all(h, w2, gs, mesh=mesh,
                                               axis_name="ep",
                                               num_tokens=T, schedule=sched)
  out = layer(x, w1, w2, gs)
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(np.float32)
  with pytest.raises(ValueError, match=rf"group_sizes must be \[{mesh.devices.size}, experts\]"):
    ficco_jax.sharded.all_to_all_matmul(x, w1, gs.reshape(-1), mesh=mesh,
                                        axis_name="ep")


@pytest.mark.parametrize("transport", [None, "rendezvous", "window"])
def test_layer_on_the_copy_engines(transport):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(29)
  args, host = _inputs(mesh, rng, "skewed", 2, np.float32)
  dma = Schedule(dataflow="direct", comm="dma", transport=transport)
  xla = Schedule(dataflow="direct")
  out = _layer(mesh, dma, None)(*args)
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(np.float32)
  # Its gradient is the XLA direct layer's.
  ct = util.put(mesh, P("ep"), rng.standard_normal((mesh.devices.size * T, D))
                .astype(np.float32))
  grads = []
  for sched in (dma, xla):
    layer = _layer(mesh, sched, None)
    loss = lambda x, w1, w2, f=layer: jnp.sum(f(x, w1, w2, args[3]) * ct)
    with jax.set_mesh(mesh):
      grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3]))
  for g_dma, g_xla in zip(*grads):
    assert util.rel_err(g_dma, g_xla) < util.tol(np.float32)


def test_copy_engines_need_jit():
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(31)
  args, _ = _inputs(mesh, rng, "random", 1, np.float32)

  def dispatch(schedule):
    def f(x, w, gs):
      return ficco_jax.all_to_all_matmul(x, w, gs[0], axis_name="ep",
                                         schedule=schedule)
    return jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3,
                         out_specs=P("ep"))
  with pytest.raises(ValueError, match="must be traced under jax.jit"):
    dispatch(Schedule(dataflow="direct", comm="dma"))(args[0], args[1],
                                                      args[3])
