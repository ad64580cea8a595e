"""ficco_jax.autotune_model: every schedule=None call of a whole function,
found while tracing, tuned once per distinct shape, and the step timed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.tuning import autotune_cache
from ficco_jax._src.tuning import model_autotune
import util

NONE = Schedule(dataflow="none")
RING = Schedule(dataflow="ring", num_chunks=1, comm="xla")
FAST = dict(warmup=1, rounds=2, iters=2)
D, F = 24, 40  # Model width and MLP width (F / 4 = 10 per device).


# Every test reads and writes its own cache file (conftest.py), never ~/.cache.
pytestmark = pytest.mark.usefixtures("user_cache")


def _mlp_step(mesh, form, layers=1, explicit=None):
  """The weight gradient of an MLP's loss on a (dp, tp) mesh: an all-gather
  matmul and a reduce-scatter matmul per layer, sequence-parallel rows."""
  rows = P(("dp", "tp"))

  def block(x, w1, w2):
    for _ in range(layers):
      h = jax.nn.relu(ficco_jax.all_gather_matmul(x, w1, axis_name="tp",
                                                  schedule=explicit))
      x = x + ficco_jax.matmul_reduce_scatter(h, w2, axis_name="tp")
    return x

  if form == "shard_map":
    body = jax.shard_map(block, mesh=mesh,
                         in_specs=(rows, P(None, "tp"), P("tp", None)),
                         out_specs=rows)
  else:  # The pjit-style forms on global [batch, seq, d] arrays.
    def body(x, w1, w2):
      for _ in range(layers):
        h = jax.nn.relu(ficco_jax.sharded.all_gather_matmul(
            x, w1, mesh=mesh, axis_name="tp", gather_axis=1,
            x_spec=P("dp", "tp"), schedule=explicit))
        x = x + ficco_jax.sharded.matmul_reduce_scatter(
            h, w2, mesh=mesh, axis_name="tp", scatter_axis=1,
            h_spec=P("dp", None, "tp"))
      return x

  def loss(w, x):
    return jnp.sum(body(x, *w) ** 2)

  return jax.grad(loss)


def _args(mesh, form="shard_map"):
  """64 tokens: rows over dp x tp, or [2, 32, d] with batch over dp and the
  sequence over tp."""
  rng = np.random.default_rng(0)
  put = lambda a, spec: jax.device_put(  # noqa: E731
      a.astype(np.float32), NamedSharding(mesh, spec))
  w = (put(rng.standard_normal((D, F)) / 5, P(None, "tp")),
       put(rng.standard_normal((F, D)) / 5, P("tp", None)))
  if form == "shard_map":
    return w, put(rng.standard_normal((64, D)), P(("dp", "tp")))
  return w, put(rng.standard_normal((2, 32, D)), P("dp", "tp"))


@pytest.mark.parametrize("form", ["shard_map", "sharded"])
def test_every_site_is_found_tuned_and_stored(form, user_cache):
  mesh = util.mesh((2, 4), ("dp", "tp"))
  step = _mlp_step(mesh, form)
  w, x = _args(mesh, form)
  # Both candidates are timed at every site, and the margin keeps "none"
  # (on CPU ring is never 99% faster): no site changes, so the entries are
  # stored whatever the step's timing (the faster-step rule has its own
  # test below, with the step's timing faked).
  r = ficco_jax.autotune_model(step, w, x, candidates=[NONE, RING],
                               margin=0.99, **FAST)
  # Both ops of the forward: the backward follows their schedules.
  sites = {s.site.op: s for s in r.sites}
  assert len(r.sites) == 2 and set(sites) == {"all_gather_matmul",
                                              "matmul_reduce_scatter"}
  ag, rs = sites["all_gather_matmul"], sites["matmul_reduce_scatter"]
  # 64 tokens over dp x tp = 8 per device; the MLP's 40 columns over tp = 10.
  lead = () if form == "shard_map" else (1,)
  assert (ag.site.x_shape, ag.site.w_shape) == (lead + (8, D), (D, F // 4))
  assert (rs.site.x_shape, rs.site.w_shape) == (lead + (32, F // 4),
                                                (F // 4, D))
  assert ag.site.axis == rs.site.axis == len(lead)
  for s in r.sites:
    assert s.calls == 1 and s.site.axis_name == "tp"
    assert s.site.axis_size == 4 and s.site.dtype == "float32"
    # Off GPUs the heuristic never overlaps.
    assert s.before == NONE and s.before_source == "heuristic"
    assert {label for label, _ in s.tuned.timings_ms} == {
        NONE.short(), RING.short()}
    # Tuned on one tp group of the arguments' mesh.
    assert s.devices == tuple(int(d.id) for d in mesh.devices[0])
  assert r.step_ms_before > 0 and r.speedup > 0
  assert r.stored and r.cache_file == str(user_cache)
  for s in r.sites:
    assert autotune_cache.lookup(s.tuned.key) == s.tuned.best
    assert ficco_jax.choose_schedule(
        s.site.op, x_shape=s.site.x_shape, w_shape=s.site.w_shape,
        dtype=np.float32, axis_size=4, axis=s.site.axis) == s.tuned.best
  assert "step:" in r.report()
  # The function, traced afresh with the stored entries, is still right.
  ref = _mlp_step(mesh, form, explicit=NONE)
  got, want = jax.jit(step)(w, x), jax.jit(ref)(w, x)
  for g, e in zip(got, want):
    assert util.rel_err(g, e) < util.tol(np.float32)


def test_calls_of_one_shape_are_one_site_and_explicit_ones_none():
  mesh = util.mesh((2, 4), ("dp", "tp"))
  w, x = _args(mesh)
  r = ficco_jax.autotune_model(_mlp_step(mesh, "shard_map", layers=3), w, x,
                               candidates=[NONE], store=False, **FAST)
  assert [s.calls for s in r.sites] == [3, 3]
  assert r.step_ms_after is None and r.speedup == 1.0
  assert "no site changed" in r.note
  # With the all-gather's schedule given, only the reduce-scatter is a site.
  r = ficco_jax.autotune_model(
      _mlp_step(mesh, "shard_map", explicit=RING), w, x, candidates=[NONE],
      store=False, **FAST)
  assert [s.site.op for s in r.sites] == ["matmul_reduce_scatter"]


@pytest.mark.parametrize("before_ms, after_ms", [(2.0, 1.0), (1.0, 2.0)])
def test_entries_are_stored_only_when_the_step_is_faster(
    monkeypatch, user_cache, before_ms, after_ms):
  """Each site alone may win and the step still lose: then nothing is
  stored. The step's timing is faked; the sites' is real."""
  mesh = util.mesh((2, 4), ("dp", "tp"))
  w, x = _args(mesh)
  real = model_autotune._time_step

  def fake(fns, args, *, rounds, iters):
    real(fns, args, rounds=rounds, iters=iters)  # Runs them, unchecked.
    return [before_ms, after_ms][:len(fns)], {}

  monkeypatch.setattr(model_autotune, "_time_step", fake)
  # RING alone: every site changes from the heuristic's "none".
  r = ficco_jax.autotune_model(_mlp_step(mesh, "shard_map"), w, x,
                               candidates=[RING], **FAST)
  assert all(s.changed and s.tuned.best == RING for s in r.sites)
  assert r.speedup == pytest.approx(before_ms / after_ms)
  keys = [s.tuned.key for s in r.sites]
  if after_ms < before_ms:
    assert r.stored and all(autotune_cache.lookup(k) == RING for k in keys)
  else:
    assert not r.stored and "not faster" in r.note and not user_cache.exists()
    assert all(autotune_cache.lookup(k) is None for k in keys)


def test_tried_schedules_do_not_outlive_the_call():
  mesh = util.mesh((2, 4), ("dp", "tp"))
  w, x = _args(mesh)
  step = _mlp_step(mesh, "shard_map")
  r = ficco_jax.autotune_model(step, w, x, candidates=[RING], store=False,
                               **FAST)
  assert not r.stored and r.step_ms_after is not None
  # Traced again, the function runs what schedule=None chose before: XLA's
  # one all-gather, no permutes.
  text = jax.jit(step).lower(w, x).as_text()
  assert "collective_permute" not in text and "all_gather" in text


def test_keyword_arguments_and_bf16_sites():
  """fn's keywords travel in fn_kwargs; a site's dtype is the operands'."""
  mesh = util.mesh((4,), ("tp",))
  rng = np.random.default_rng(1)
  x = util.put(mesh, P("tp"), util.rand(rng, (32, 24), jnp.bfloat16))
  w = util.put(mesh, P(None, "tp"), util.rand(rng, (24, 16), jnp.bfloat16))

  def fn(w, *, x):
    return jax.shard_map(
        lambda x, w: ficco_jax.all_gather_matmul(x, w, axis_name="tp"),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"))(x, w)

  r = ficco_jax.autotune_model(fn, w, fn_kwargs={"x": x}, candidates=[NONE],
                               store=False, **FAST)
  [s] = r.sites
  assert s.site.dtype == "bfloat16" and s.site.x_shape == (8, 24)


def test_calls_over_two_axes_of_one_size_are_one_site(user_cache):
  """The cache key has the axis size, not its name: one tuning, one entry."""
  mesh = util.mesh((2, 2, 2), ("a", "b", "c"))
  rng = np.random.default_rng(2)
  x = util.put(mesh, P(), util.rand(rng, (8, 12), np.float32))
  w = util.put(mesh, P(), util.rand(rng, (12, 6), np.float32))

  def fn(x, w):
    def body(x, w):
      ag = lambda a: ficco_jax.all_gather_matmul(x, w, axis_name=a)  # noqa: E731
      return ag("b") + ag("c")
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                         out_specs=P(), check_vma=False)(x, w)

  # "none" alone: no site changes, so the entry is stored.
  r = ficco_jax.autotune_model(fn, x, w, candidates=[NONE], **FAST)
  [s] = r.sites
  assert s.calls == 2 and s.axis_names == ("b", "c")
  assert "also over 'c'" in r.report()
  assert r.stored and "stored 1 entries" in r.note
  # Tuned on a group along "b": devices differing only in b's index.
  assert len(s.devices) == 2


def test_arguments_are_checked_before_any_timing(tmp_path):
  mesh = util.mesh((2, 4), ("dp", "tp"))
  w, x = _args(mesh)
  step = _mlp_step(mesh, "shard_map")
  with pytest.raises(TypeError, match="fn must be callable"):
    ficco_jax.autotune_model("step", w, x)
  with pytest.raises(ValueError, match="margin=1.5"):
    ficco_jax.autotune_model(step, w, x, margin=1.5)
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    ficco_jax.autotune_model(step, w, x, mesh="tp")
  with pytest.raises(ValueError, match="makes no tensor-parallel ficco call with"):
    ficco_jax.autotune_model(lambda a: jnp.sum(a * 2), x)
  with pytest.raises(ValueError, match="must be a non-empty sequence"):
    ficco_jax.autotune_model(step, w, x, candidates=[])
  with pytest.raises(TypeError, match="not jax.ShapeDtypeStruct"):
    ficco_jax.autotune_model(step, w, jax.ShapeDtypeStruct(x.shape, x.dtype))
  with pytest.raises(TypeError, match="fn_kwargs must be a dict"):
    ficco_jax.autotune_model(step, w, x, fn_kwargs=[1])
  with pytest.raises(ValueError, match="has no axis 'tp' of size 4"):
    ficco_jax.autotune_model(step, w, x, mesh=util.mesh((8,), ("x",)),
                             candidates=[NONE], store=False, **FAST)
  # A cache under a file cannot be written: said before anything compiles.
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("x")
  ficco_jax.set_autotune_cache(blocker / "autotune.json")
  with pytest.raises(OSError, match="cannot be written"):
    ficco_jax.autotune_model(step, w, x)
