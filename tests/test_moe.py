"""The MoE ops (`all_to_all_matmul`, `matmul_all_to_all`) against a
per-token reference, across routings, schedules, dtypes and axis sizes."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src import devices

import util

pytestmark = pytest.mark.multigpu

T, D, F = 13, 6, 5  # tokens per device, model and expert widths
SCHEDULES = [None, Schedule(dataflow="none"), Schedule(dataflow="direct"),
             Schedule(dataflow="none", compute="pallas"),
             Schedule(dataflow="direct", compute="pallas")]
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


def _check_vma(schedule) -> bool:
  # Off GPUs compute="pallas" runs Pallas's interpreter, which shard_map's
  # varying-axes check rejects (grouped_matmul._portable).
  return util.on_gpu() or schedule is None or schedule.compute != "pallas"


def _layer(mesh, schedule, capacity, piece_capacity=None):
  if (util.on_gpu() and schedule is not None and schedule.compute == "pallas"
      and (D % 128 or F % 128)):
    pytest.skip("the GPU grouped-matmul kernel takes d and f multiples of"
                " 128 in bf16: test_pallas_experts_at_kernel_shapes")
  def f(x, w1, w2, gs):
    gs = gs[0]
    h = ficco_jax.all_to_all_matmul(x, w1, gs, axis_name="ep",
                                    capacity=capacity,
                                    piece_capacity=piece_capacity,
                                    schedule=schedule)
    h = jax.nn.relu(h).astype(x.dtype)
    return ficco_jax.matmul_all_to_all(h, w2, gs, axis_name="ep",
                                       num_tokens=x.shape[0],
                                       piece_capacity=piece_capacity,
                                       schedule=schedule)
  return jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P("ep")),
      out_specs=P("ep"), check_vma=_check_vma(schedule)))


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


@pytest.mark.parametrize("dtype, compute", [
    (jnp.bfloat16, "xla"), (np.float64, "xla"),
    # The portable kernel accumulates f64 in f64, not f32.
    (np.float64, "pallas")])
def test_layer_dtypes_and_a_tight_capacity(dtype, compute):
  if compute == "pallas" and util.on_gpu():
    pytest.skip("the GPU grouped kernel takes 16-bit operands")
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(7)
  args, host = _inputs(mesh, rng, "random", 2, dtype)
  gs = host[3]
  p = mesh.devices.size
  # Exactly the most rows any device receives: nothing to spare.
  need = max(gs[:, r * 2:(r + 1) * 2].sum() for r in range(p))
  schedule = Schedule(dataflow="direct", compute=compute)
  layer = _layer(mesh, schedule, int(need))
  out = layer(*args)
  assert out.dtype == dtype
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(dtype)
  if compute == "pallas":  # And its gradient, against XLA's in f64.
    ct = rng.standard_normal(out.shape)
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a, args[3]) * ct),
                              argnums=(0, 1, 2)))(*args[:3])
             for f in (layer, _layer(mesh, Schedule(dataflow="direct"),
                                     int(need)))]
    for g, want in zip(*grads):
      assert util.rel_err(g, want) < util.tol(dtype)


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


def test_combine_overflow_names_the_rows_of_h():
  """The combine has no capacity argument: its bound is h's rows (the
  dispatch's capacity), and the error says so."""
  mesh = util.mesh((4,), ("ep",))
  p = 4
  gs = np.zeros((p, p), np.int32)
  gs[:, 2] = T  # Device 2 gets back p * T rows; h holds fewer.
  h = np.ones((p * (p * T - 1), F), np.float32)
  w2 = np.ones((p, F, D), np.float32)
  f = jax.jit(functools.partial(ficco_jax.sharded.matmul_all_to_all,
                                mesh=mesh, axis_name="ep", num_tokens=T,
                                schedule=Schedule(dataflow="none")))
  with pytest.raises(Exception, match=rf"on device 2 of axis 'ep', the"
                     rf" routing returns {p * T} rows, more than the"
                     rf" {p * T - 1} rows of h \(h.shape\[0\], the capacity"
                     r" of the all_to_all_matmul that made it"):
    jax.block_until_ready(f(h, w2, gs))


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
    ("negative", r"1 of axis 'ep', group_sizes has a negative count \(-1\)"),
    ("too_many", r"1 of axis 'ep', group_sizes routes 14 rows, more than the"
     " 13 token rows"),
    # int64 counts are read as they are, not after the exchange's int32
    # cast (where 2**32 + 1 would read 1).
    ("wraps_at_int32", r"1 of axis 'ep', group_sizes has a count of"
     " 4294967297, more than the 13 token rows"),
    ("unsigned", r"1 of axis 'ep', group_sizes has a count of"
     " 4294967297, more than the 13 token rows"),
    # Device 3 routes 14 of its 13 rows, which also overfills device 0:
    # the cause is named, not device 0's capacity.
    ("cause_before_capacity", r"3 of axis 'ep', group_sizes has a count of"
     " 14, more than the 13 token rows"),
])
def test_invalid_counts_are_an_error_not_wrong_rows(counts, match):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(19)
  args, host = _inputs(mesh, rng, "random", 1, np.float32)
  gs = np.array(host[3])
  if counts == "negative":
    gs[1, 0] = -1
  elif counts == "too_many":
    gs[1, 0] += T + 1 - gs[1].sum()
  elif counts in ("wraps_at_int32", "unsigned"):
    gs = gs.astype(np.int64 if counts == "wraps_at_int32" else np.uint64)
    gs[1, 0] = 2**32 + 1
  else:
    gs[:] = 0
    gs[:, 0] = T  # Device 0 receives every token: 4 * 13, its capacity.
    gs[3, 0] = T + 1
  bad = util.put(mesh, P("ep"), gs)
  with pytest.raises(Exception, match="on device " + match):
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
    (dict(gs=[0] * 8), r"group_sizes is a Python list; pass an integer array"),
    (dict(check_routing="no"), r"check_routing must be True or False"),
    (dict(preferred="foo"),
     r"all_to_all_matmul: preferred_element_type='foo' is not a dtype"),
    # Checked on every call, not only where the copy engines read it.
    (dict(timeout_s=-1), r"timeout_s=-1 must be a finite number of seconds"),
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
        preferred_element_type=bad.get("preferred"),
        check_routing=bad.get("check_routing", True),
        timeout_s=bad.get("timeout_s", 60))
  with pytest.raises((TypeError, ValueError), match=match):
    if isinstance(gs, list):  # Not an array: closed over, not an argument.
      jax.shard_map(lambda x, w: f(x, w, gs), mesh=mesh, in_specs=(P(), P()),
                    out_specs=P(), check_vma=False)(x, w)
    else:
      jax.shard_map(f, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                    check_vma=False)(x, w, gs)


@pytest.mark.parametrize("vmapped", ["x", "group_sizes"])
def test_vmap_is_a_clear_error(vmapped):
  mesh = util.tp_mesh(4, "ep")
  p = mesh.devices.size
  x = np.zeros((p * 3, T, D), np.float32)
  w = np.zeros((p * 2, D, F), np.float32)
  gs = np.zeros((p, 3, p * 2), np.int32)

  def f(x, w, gs):
    if vmapped == "x":
      return jax.vmap(lambda xb: ficco_jax.all_to_all_matmul(
          xb, w, gs[0, 0], axis_name="ep"))(x)
    return jax.vmap(lambda g: ficco_jax.all_to_all_matmul(
        x[0], w, g, axis_name="ep"))(gs[0])
  with pytest.raises(NotImplementedError,
                     match=rf"{vmapped} is batched by jax.vmap"):
    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3,
                          out_specs=P("ep")))(
                              *(util.put(mesh, P("ep"), a) for a in (x, w, gs)))


def test_autodiff_around_an_eager_or_vmapped_call_is_the_same_error():
  """The tracers of jax.grad around an eager shard_map, or of jax.grad
  under jax.vmap, hide the ones that matter: the ops look through them."""
  mesh = util.tp_mesh(4, "ep")
  p = mesh.devices.size
  rng = np.random.default_rng(3)
  x = rng.standard_normal((p * T, D)).astype(np.float32)
  w = rng.standard_normal((p * 2, D, F)).astype(np.float32)
  gs = np.stack([rng.multinomial(T, np.ones(2 * p) / (2 * p))
                 for _ in range(p)]).astype(np.int32)
  dma = Schedule(dataflow="direct", comm="dma")
  op = jax.shard_map(
      lambda x, w, g: ficco_jax.all_to_all_matmul(x, w, g[0], axis_name="ep",
                                                  schedule=dma),
      mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
  args = [util.put(mesh, P("ep"), a) for a in (x, w, gs)]
  loss = lambda x, w, g: jnp.sum(op(x, w, g) ** 2)  # noqa: E731
  with pytest.raises(ValueError, match="must be traced under jax.jit"):
    jax.grad(loss)(*args)
  xs = util.put(mesh, P(None, "ep"), np.stack([x] * 2))
  with pytest.raises(NotImplementedError, match="x is batched by jax.vmap"):
    jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None, None)))(xs, *args[1:])


@pytest.mark.parametrize("sched", [
    Schedule(dataflow="direct"),
    # Off GPUs: the interpreter, which the sharded form lets run.
    pytest.param(Schedule(dataflow="direct", compute="pallas"),
                 marks=pytest.mark.skipif(
                     util.on_gpu(), reason="f32 rows: the GPU kernel's"
                     " case is test_pallas_experts_at_kernel_shapes"))],
    ids=sched_id)
def test_sharded_forms_match_the_per_shard_layer(sched):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(13)
  args, host = _inputs(mesh, rng, "random", 2, np.float32)
  x, w1, w2, gs = args

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
  with pytest.raises(ValueError, match=r"w must be global \[experts, d, f\]"
                     r" with experts a multiple of the \d+ devices"):
    ficco_jax.sharded.all_to_all_matmul(x, np.asarray(w1)[:-1], gs, mesh=mesh,
                                        axis_name="ep")
  with pytest.raises(ValueError, match=r"h must be global \[rows, d\] with"
                     r" rows a multiple"):
    ficco_jax.sharded.matmul_all_to_all(np.asarray(x)[:-1], w2, gs, mesh=mesh,
                                        axis_name="ep", num_tokens=T)
  with pytest.raises(ValueError, match=rf"group_sizes must be \[{mesh.devices.size}, experts\]"):
    ficco_jax.sharded.all_to_all_matmul(x, w1, gs.reshape(-1), mesh=mesh,
                                        axis_name="ep")
  for bad in (np.asarray(gs, np.float32), np.asarray(gs).tolist()):
    with pytest.raises(TypeError, match=rf"group_sizes must be an integer"
                       rf" \[{mesh.devices.size}, experts\] array"):
      ficco_jax.sharded.all_to_all_matmul(x, w1, bad, mesh=mesh,
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


@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="none", compute="pallas"),
    Schedule(dataflow="direct", compute="pallas"),
    Schedule(dataflow="direct", comm="dma", compute="pallas")], ids=sched_id)
def test_pallas_experts_at_kernel_shapes(schedule):
  """bf16 rows at widths the GPU kernel takes (the CPU runs the portable
  kernel): the layer against the float64 reference, its gradient against
  the XLA layer's, with a tight piece capacity."""
  mesh = util.tp_mesh(4, "ep")
  p, e_local, t, d, f = mesh.devices.size, 2, 200, 256, 128
  rng = np.random.default_rng(41)
  x = util.rand(rng, (p * t, d), jnp.bfloat16)
  w1 = (util.rand(rng, (p * e_local, d, f), np.float32) * 0.1).astype(
      jnp.bfloat16)
  w2 = (util.rand(rng, (p * e_local, f, d), np.float32) * 0.1).astype(
      jnp.bfloat16)
  weights = 1.0 / np.arange(1, p * e_local + 1) ** 1.2
  gs = rng.multinomial(t - 7, weights / weights.sum(), size=p).astype(np.int32)
  piece = int(max(gs[s, r * e_local:(r + 1) * e_local].sum()
                  for s in range(p) for r in range(p)))
  assert piece < t

  def layer(sched):
    def body(x, w1, w2, gs):
      gs = gs[0]
      h = ficco_jax.all_to_all_matmul(x, w1, gs, axis_name="ep",
                                      piece_capacity=piece, schedule=sched)
      h = jax.nn.relu(h).astype(x.dtype)
      return ficco_jax.matmul_all_to_all(h, w2, gs, axis_name="ep",
                                         num_tokens=t, piece_capacity=piece,
                                         schedule=sched)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4,
                                 out_specs=P("ep"),
                                 check_vma=_check_vma(sched)))
  args = [util.put(mesh, P("ep"), a) for a in (x, w1, w2, gs)]
  out = layer(schedule)(*args)
  # The reference, per token in float64 (relu of the bf16-rounded h).
  xs = np.asarray(x, np.float64).reshape(p, t, d)
  ref = np.zeros((p, t, d))
  for s_ in range(p):
    for i, e in enumerate(_expert_of_rows(gs[s_], t)):
      if e >= 0:
        h = np.asarray(jnp.asarray(xs[s_, i] @ np.asarray(w1[e], np.float64),
                                   jnp.bfloat16), np.float64)
        ref[s_, i] = np.maximum(h, 0) @ np.asarray(w2[e], np.float64)
  assert util.rel_err(out, ref.reshape(p * t, d)) < util.tol(jnp.bfloat16)
  ct = util.put(mesh, P("ep"), util.rand(rng, (p * t, d), jnp.bfloat16))
  grads = []
  for sched in (schedule, Schedule(dataflow="direct")):
    fn = layer(sched)
    loss = lambda x, w1, w2, fn=fn: jnp.sum(
        fn(x, w1, w2, args[3]).astype(jnp.float32) * ct.astype(jnp.float32))
    with jax.set_mesh(mesh):
      grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3]))
  for name, g_k, g_x in zip(("x", "w1", "w2"), *grads):
    assert util.rel_err(g_k, g_x) < util.tol(jnp.bfloat16), name


@pytest.mark.parametrize("schedule", SCHEDULES[1:3], ids=sched_id)
def test_piece_capacity_overflow_is_an_error(schedule):
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(43)
  args, host = _inputs(mesh, rng, "one_device", 1, np.float32)
  # Every device sends all its T rows to device 1.
  with pytest.raises(Exception, match=r"on device 1 of axis 'ep', one peer"
                     rf" sends {T} rows, more than the 5 rows of a piece"
                     r" \(piece_capacity\)"):
    jax.block_until_ready(_layer(mesh, schedule, None, 5)(*args))
  out = _layer(mesh, schedule, None, T)(*args)
  assert util.rel_err(out, _ref_layer(*host)) < util.tol(np.float32)


def test_pallas_experts_reject_precision():
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(47)
  args, _ = _inputs(mesh, rng, "random", 1, np.float32)

  def f(x, w, gs):
    return ficco_jax.all_to_all_matmul(
        x, w, gs[0], axis_name="ep", precision=jax.lax.Precision.HIGHEST,
        schedule=Schedule(dataflow="none", compute="pallas"))
  with pytest.raises(ValueError, match=r"precision=.*compute='pallas'"):
    jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"),
                  check_vma=False)(args[0], args[1], args[3])


class _FakeGpu:
  platform = "gpu"
  device_kind = "Fake GPU"

  def __init__(self, cc):
    self.compute_capability = cc


def test_default_schedule_puts_the_experts_on_the_kernel_on_hopper(
    monkeypatch):
  from ficco_jax._src.ops.moe import api  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.tuning import moe_heuristic  # pylint: disable=g-import-not-at-top
  bf16 = jnp.dtype(jnp.bfloat16)
  x = jnp.zeros((64, 256), bf16)
  w = jnp.zeros((2, 256, 384), bf16)
  on_hopper = util.on_gpu() and str(
      jax.devices()[0].compute_capability).startswith("9")
  ops = ("all_to_all_matmul", "matmul_all_to_all")
  assert api.default_schedule(ops[0], x, w, None, bf16).compute == (
      "pallas" if on_hopper else "xla")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGpu("9.0")])
  narrow = Schedule(dataflow="direct", comm="dma", compute="pallas")
  wide = Schedule(dataflow="none", compute="pallas")
  # The experts' width f: w's last axis for the dispatch, its middle one
  # for the combine. At most DIRECT_MAX_F: the copy engines.
  f = moe_heuristic.DIRECT_MAX_F
  for op, shape in ((ops[0], (2, 256, f)), (ops[1], (2, f, 256))):
    assert api.default_schedule(op, x, jnp.zeros(shape, bf16), None,
                                bf16) == narrow, op
  for op, shape in ((ops[0], (2, 256, f + 128)), (ops[1], (2, f + 128, 256)),
                    (ops[0], (2, f + 128, 256)), (ops[1], (2, 256, f + 128))):
    want = wide if shape[1 if op == ops[1] else 2] > f else narrow
    assert api.default_schedule(op, x, jnp.zeros(shape, bf16), None,
                                bf16) == want, (op, shape)
  # Eager shard_map and vmap cannot run the copy engines (they need one
  # compiled program): schedule=None keeps one all-to-all each way there.
  for tracer in ("ShardMapTracer", "BatchTracer"):
    rows = type(tracer, (), {"dtype": bf16, "shape": x.shape})()
    assert api.default_schedule(ops[0], rows, w, None, bf16) == wide, tracer
  # One process per GPU keeps one all-to-all each way.
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert api.default_schedule(ops[0], x, w, None, bf16) == wide
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  # Where the kernel cannot take the call: XLA's ragged_dot, not an error.
  f32 = jnp.dtype(np.float32)
  for a, b, prec, out in (
      (x.astype(f32), w.astype(f32), None, f32),
      (x, w[:, :, :320], None, bf16),  # f = 320: not a 128 multiple
      (x, w, jax.lax.Precision.HIGHEST, bf16),
      (x, w, None, f32)):  # preferred_element_type=float32
    for op in ops:
      assert api.default_schedule(op, a, b, prec, out) == Schedule(
          dataflow="none")
  for cc in ("8.0", "10.0"):  # No wgmma there.
    monkeypatch.setattr(jax, "devices", lambda *a, cc=cc: [_FakeGpu(cc)])
    assert api.default_schedule(ops[0], x, w, None, bf16) == Schedule(
        dataflow="none")


@pytest.mark.parametrize("op, w_shape", [
    ("all_to_all_matmul", (4, 256, 768)),     # narrow experts
    ("all_to_all_matmul", (4, 256, 8192)),    # wide experts
    ("matmul_all_to_all", (4, 768, 256)),
    ("matmul_all_to_all", (4, 8192, 256)),
    ("all_to_all_matmul", (4, 256, 320)),     # f: no kernel tile
])
def test_choose_schedule_and_explain_agree_with_the_moe_ops(
    monkeypatch, op, w_shape):
  from ficco_jax._src.ops.moe import api  # pylint: disable=g-import-not-at-top
  bf16 = jnp.dtype(jnp.bfloat16)
  x = jnp.zeros((64, w_shape[1]), bf16)
  w = jnp.zeros(w_shape, bf16)
  # Here, then on a (fake) Hopper GPU at hand.
  for fake in (False, True):
    if fake:
      monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
      monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGpu("9.0")])
    want = api.default_schedule(op, x, w, None, bf16)
    kw = dict(x_shape=x.shape, w_shape=w.shape, dtype=bf16, axis_size=2)
    assert ficco_jax.choose_schedule(op, **kw) == want
    e = ficco_jax.explain(op, **kw)
    assert e.chosen == want and e.source == "heuristic"
    assert want.short() in str(e) and e.reason in str(e)
  # Planned from here for another kind: as a GPU of that kind.
  h200 = ficco_jax.choose_schedule(op, **kw, device_kind="NVIDIA H200")
  a100 = ficco_jax.choose_schedule(op, **kw, device_kind="NVIDIA A100")
  assert a100 == Schedule(dataflow="none")  # No wgmma: ragged_dot.
  if w_shape[2] % 128:
    assert h200 == Schedule(dataflow="none")
    assert "not a multiple of 128" in ficco_jax.explain(
        op, **kw, device_kind="NVIDIA H200").kernel
  else:
    f = w_shape[2] if op == "all_to_all_matmul" else w_shape[1]
    assert h200.compute == "pallas"
    assert (h200.dataflow, h200.comm) == (
        ("direct", "dma") if f <= 4096 else ("none", "xla")), h200


def test_explicit_pallas_experts_name_what_the_gpu_kernel_cannot_take(
    monkeypatch):
  mesh = util.tp_mesh(4, "ep")
  p = mesh.devices.size
  # Traced as for a Hopper GPU (the mesh itself is of CPUs).
  monkeypatch.setattr(devices, "platform", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGpu("9.0")])
  x = jnp.zeros((16, 128), jnp.bfloat16)
  w = jnp.zeros((1, 128, 192), jnp.bfloat16)
  gs = jnp.zeros((p,), jnp.int32)
  sched = Schedule(dataflow="none", compute="pallas")
  with pytest.raises(ValueError, match=r"all_to_all_matmul: .*cannot take"
                     r" this call: w.shape\[2\]=192 \(w \(1, 128, 192\)\) is not a"
                     r" multiple of 128"):
    jax.make_jaxpr(jax.shard_map(
        lambda x, w, g: ficco_jax.all_to_all_matmul(
            x, w, g, axis_name="ep", schedule=sched),
        mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
        check_vma=False))(x, w, gs)
  with pytest.raises(ValueError, match=r"preferred_element_type=float32"):
    jax.make_jaxpr(jax.shard_map(
        lambda x, w, g: ficco_jax.all_to_all_matmul(
            x, w[:, :, :128], g, axis_name="ep", schedule=sched,
            preferred_element_type=jnp.float32),
        mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
        check_vma=False))(x, w, gs)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_pieces_have_piece_capacity_rows(op):
  """The exchange moves [P, piece_capacity, d] pieces, not [P, T, d]."""
  mesh = util.tp_mesh(4, "ep")
  p = mesh.devices.size
  rng = np.random.default_rng(53)
  args, _ = _inputs(mesh, rng, "random", 1, np.float32)

  def f(x, w, gs):
    if op == "dispatch":
      return ficco_jax.all_to_all_matmul(x, w, gs[0], axis_name="ep",
                                         piece_capacity=7, capacity=p * 7,
                                         check_routing=False)
    h = jnp.zeros((p * 7, D), x.dtype)  # The products travel: [., F].
    return ficco_jax.matmul_all_to_all(h, w, gs[0], axis_name="ep",
                                       num_tokens=T, piece_capacity=7,
                                       check_routing=False)
  hlo = jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))).lower(
          args[0], args[1], args[3]).as_text()
  width = D if op == "dispatch" else F  # Rows, or their products.
  assert re.search(rf"all_to_all.*tensor<{p}x7x{width}xf32>", hlo), hlo[:3000]
  assert not re.search(rf"all_to_all.*tensor<{p}x{T}x{width}xf32>", hlo)


def test_autotune_times_a_moe_op_and_schedule_none_follows_it(user_cache):
  from ficco_jax._src.tuning import autotune_cache  # pylint: disable=g-import-not-at-top
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(5)
  (x, w1, _, gs), _ = _inputs(mesh, rng, "skewed", 2, np.float32)
  res = ficco_jax.autotune("all_to_all_matmul", x, w1, mesh=mesh,
                           axis_name="ep", group_sizes=gs,
                           op_kwargs={"capacity": 4 * T}, warmup=1,
                           rounds=2, iters=2)
  assert res.key.op == "all_to_all_matmul"
  assert (res.key.x_shape, res.key.w_shape) == ((T, D), (2, D, F))
  labels = {label for label, _ in res.timings_ms}
  assert {"none/c1/xla/xla", "direct/c1/xla/xla"} <= labels, res
  assert not res.errors, res.errors
  stored = json.loads(user_cache.read_text())["entries"]
  assert [e["key"]["op"] for e in stored] == ["all_to_all_matmul"]

  def permutes():
    # direct sends a piece per peer with its own ppermute; none sends all
    # of them in one all_to_all.
    f = jax.jit(functools.partial(ficco_jax.sharded.all_to_all_matmul,
                                  mesh=mesh, axis_name="ep"))
    return len(re.findall(r"stablehlo\.collective_permute\b",
                          f.lower(x, w1, gs).as_text()))

  kw = dict(x_shape=(T, D), w_shape=(2, D, F), dtype=np.float32,
            axis_size=4)
  for forced in (Schedule(dataflow="direct"), Schedule(dataflow="none")):
    autotune_cache.store(res.key, forced)
    assert ficco_jax.choose_schedule("all_to_all_matmul", **kw) == forced
    e = ficco_jax.explain("all_to_all_matmul", **kw)
    assert (e.chosen, e.source) == (forced, "autotune cache")
    assert (permutes() > 0) == (forced.dataflow == "direct"), forced


def test_autotune_takes_group_sizes_for_the_moe_ops_only():
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(6)
  (x, w1, _, gs), _ = _inputs(mesh, rng, "random", 2, np.float32)
  with pytest.raises(ValueError, match="needs group_sizes"):
    ficco_jax.autotune("all_to_all_matmul", x, w1, mesh=mesh,
                       axis_name="ep", store=False)
  with pytest.raises(ValueError, match="all_gather_matmul takes neither"):
    ficco_jax.autotune("all_gather_matmul", x, x.T, mesh=mesh,
                       axis_name="ep", group_sizes=gs, store=False)


@pytest.mark.parametrize("entry, why", [
    (Schedule(dataflow="ring"), "not supported by the MoE ops"),
    (Schedule(dataflow="direct", num_chunks=T), f"num_chunks={T}"),
    # Off GPUs the kernel is Pallas's interpreter; on GPUs these f32 rows
    # are not the Hopper kernel's.
    (Schedule(dataflow="none", compute="pallas"),
     {"cpu": "interpreter", "gpu": "bf16/f16 rows"}),
])
def test_a_cache_entry_the_call_cannot_run_is_logged_not_run(
    user_cache, caplog, entry, why):
  from ficco_jax._src.tuning import autotune_cache  # pylint: disable=g-import-not-at-top
  if isinstance(why, dict):
    why = why[util.test_devices()[0].platform]
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(7)
  (x, w1, _, gs), _ = _inputs(mesh, rng, "random", 2, np.float32)
  key = autotune_cache.Key.of(
      "all_to_all_matmul", device_kind=util.test_devices()[0].device_kind,
      axis_size=4, x_shape=(T, D), w_shape=(2, D, F), axis=0,
      dtype=np.float32)
  autotune_cache.store(key, entry)
  f = jax.jit(functools.partial(ficco_jax.sharded.all_to_all_matmul,
                                mesh=mesh, axis_name="ep"))
  with caplog.at_level("WARNING", logger="ficco_jax"):
    f(x, w1, gs)  # Runs: the heuristic's pick.
  assert f"autotune cache's {entry.short()}" in caplog.text
  assert why in caplog.text
  kw = dict(x_shape=(T, D), w_shape=(2, D, F), dtype=np.float32,
            axis_size=4)
  e = ficco_jax.explain("all_to_all_matmul", **kw)
  assert e.source == "heuristic" and e.chosen == Schedule(dataflow="none")
  assert why in e.reason
  assert ficco_jax.choose_schedule("all_to_all_matmul", **kw) == e.chosen


def test_autotune_names_bad_moe_arguments():
  mesh = util.tp_mesh(4, "ep")
  rng = np.random.default_rng(8)
  (x, w1, _, gs), _ = _inputs(mesh, rng, "random", 2, np.float32)
  kw = dict(mesh=mesh, axis_name="ep", store=False)
  with pytest.raises(ValueError, match=r"op_kwargs \['schedule'\] are not"):
    ficco_jax.autotune("all_to_all_matmul", x, w1, group_sizes=gs,
                       op_kwargs={"schedule": None}, **kw)
  with pytest.raises(ValueError, match=r"op_kwargs \['num_tokens'\]"):
    ficco_jax.autotune("all_to_all_matmul", x, w1, group_sizes=gs,
                       op_kwargs={"num_tokens": T}, **kw)
  with pytest.raises(ValueError, match=r"group_sizes must be \[4, 8\]"):
    ficco_jax.autotune("all_to_all_matmul", x, w1, group_sizes=gs[:, :4],
                       **kw)
  with pytest.raises(ValueError, match="exchanges rows"):
    ficco_jax.autotune("all_to_all_matmul", x, w1, group_sizes=gs, axis=1,
                       **kw)
