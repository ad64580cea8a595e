"""Autotune cache and the order schedule=None resolves in: explicit > cache > heuristic."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.tuning import autotune_cache
from ficco_jax._src import plan as plan_lib
import util

X_LOCAL, W_LOCAL = (6, 10), (10, 7)  # Per device on a 4-device axis.
RING = Schedule(dataflow="ring", num_chunks=1, comm="xla")
NONE = Schedule(dataflow="none")


# Every test reads and writes its own cache file (conftest.py), never ~/.cache.
pytestmark = pytest.mark.usefixtures("user_cache")


def _key(x_shape=X_LOCAL, w_shape=W_LOCAL, dtype=np.float32, axis_size=4):
  return autotune_cache.Key.of(
      "all_gather_matmul", device_kind=util.test_devices()[0].device_kind,
      axis_size=axis_size, x_shape=x_shape, w_shape=w_shape, axis=0,
      dtype=dtype)


def _count(text, op):
  # StableHLO spells them "stablehlo.all_gather"(...) / stablehlo.collective_permute.
  return len(re.findall(rf"stablehlo\.{op}\b", text))


def _compiled(schedule=None, x_local=X_LOCAL, w_local=W_LOCAL):
  """StableHLO of the public op inside shard_map, traced afresh (no jit cache).

  The lowered module, not the compiled one: XLA:GPU combines permutes, so
  only the lowering shows one per planned piece on every platform.
  """
  mesh = util.mesh((4,), ("x",))
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                        schedule=schedule),
      mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
  x = jax.ShapeDtypeStruct((4 * x_local[0], x_local[1]), np.float32,
                           sharding=NamedSharding(mesh, P("x")))
  w = jax.ShapeDtypeStruct((w_local[0], 4 * w_local[1]), np.float32,
                           sharding=NamedSharding(mesh, P(None, "x")))
  return f.lower(x, w).as_text()


def _ran(text):
  """Which schedule the HLO shows: 'none' (one all-gather) or permutes."""
  if _count(text, "all_gather") == 1 and _count(text, "collective_permute") == 0:
    return "none"
  assert _count(text, "all_gather") == 0
  return _count(text, "collective_permute")


def _permutes(schedule):
  return len(plan_lib.gather_plan(schedule, axis_size=4,
                                  shard_rows=X_LOCAL[0]).transfers)


def test_cache_round_trip(user_cache):
  key = _key()
  assert autotune_cache.lookup(key) is None
  path = autotune_cache.store(key, RING, timings_ms={"ring/c1/xla/xla": 1.5})
  assert path == user_cache
  assert autotune_cache.lookup(key) == RING
  data = json.loads(user_cache.read_text())
  assert data["format"] == 1 and len(data["entries"]) == 1
  assert data["entries"][0]["timings_ms"] == {"ring/c1/xla/xla": 1.5}
  # Storing again replaces the entry; other keys are kept.
  other = _key(x_shape=(12, 10))
  autotune_cache.store(other, NONE)
  autotune_cache.store(key, Schedule(dataflow="direct", num_chunks=2))
  assert autotune_cache.lookup(key) == Schedule(dataflow="direct", num_chunks=2)
  assert autotune_cache.lookup(other) == NONE
  assert len(json.loads(user_cache.read_text())["entries"]) == 2
  # A different dtype, axis size or device kind is a different problem.
  assert autotune_cache.lookup(_key(dtype=np.float64)) is None
  assert autotune_cache.lookup(_key(axis_size=2)) is None


def test_package_data_is_overlaid_by_the_user_file(tmp_path, monkeypatch):
  key = _key()
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  name = autotune_cache.device_params.slug(key.device_kind) + ".json"
  (pkg / name).write_text(json.dumps({"format": 1, "entries": [
      {"key": key.to_json(),
       "schedule": autotune_cache.schedule_to_json(RING)}]}))
  monkeypatch.setattr(autotune_cache, "PACKAGE_DIR", pkg)
  autotune_cache._package.cache_clear()  # pylint: disable=protected-access
  try:
    assert autotune_cache.lookup(key) == RING
    autotune_cache.store(key, NONE)
    assert autotune_cache.lookup(key) == NONE
  finally:
    autotune_cache._package.cache_clear()  # pylint: disable=protected-access


def test_shipped_package_files_are_valid():
  files = sorted(autotune_cache.PACKAGE_DIR.glob("*.json"))
  assert any(f.name == "nvidia_h200.json" for f in files)
  for f in files:
    data = json.loads(f.read_text())
    assert "comment" in data
    autotune_cache._parse(data, str(f))  # pylint: disable=protected-access


def test_malformed_cache_is_ignored_with_a_clear_warning(user_cache, caplog):
  user_cache.write_text('{"format": 1, "entries": [{"key": {}}]}')
  with caplog.at_level("WARNING", logger="ficco_jax"):
    assert autotune_cache.lookup(_key()) is None
  assert "entry 0 is malformed" in caplog.text and str(user_cache) in caplog.text


@pytest.mark.parametrize("bad", [dict(compute_granularity="halving"),
                                 dict(num_chunks=2.0)], ids=["value", "type"])
def test_an_entry_that_no_longer_validates_is_skipped_alone(user_cache,
                                                            caplog, bad):
  """An entry an earlier version stored (ring with 'halving', which a
  Schedule now refuses) or a hand edit mistyped costs only itself, not the
  file's other entries."""
  good = dict(autotune_cache.schedule_to_json(RING))
  stale = dict(good, **bad)
  other = _key(x_shape=(12, 10))
  user_cache.write_text(json.dumps({"format": 1, "entries": [
      {"key": other.to_json(), "schedule": stale},
      {"key": _key().to_json(), "schedule": good}]}))
  with caplog.at_level("WARNING", logger="ficco_jax"):
    assert autotune_cache.lookup(_key()) == RING
    assert autotune_cache.lookup(other) is None
  assert "entry 0's schedule" in caplog.text and "no longer validates" in (
      caplog.text)


def test_a_cache_path_that_is_a_directory_is_an_error_not_moved(tmp_path):
  folder = tmp_path / "mine"
  folder.mkdir()
  (folder / "keep.txt").write_text("x")
  ficco_jax.set_autotune_cache(folder)
  try:
    with pytest.raises(OSError, match=r"mine cannot be written .*not a"
                       r" regular file"):
      autotune_cache.store(_key(), RING)
  finally:
    ficco_jax.set_autotune_cache(None)
  assert (folder / "keep.txt").read_text() == "x"
  assert not list(tmp_path.glob("mine.corrupt-*"))


def test_precedence_heuristic_then_cache_then_explicit():
  # 3. Heuristic: on CPU (and this small), no overlap.
  assert _ran(_compiled()) == "none"
  # 2. A cache entry for these local shapes on this device kind wins.
  autotune_cache.store(_key(), RING)
  assert _ran(_compiled()) == _permutes(RING)
  # ... but only for its own shapes.
  assert _ran(_compiled(x_local=(12, 10))) == "none"
  # 1. An explicit schedule beats the cache.
  assert _ran(_compiled(NONE)) == "none"
  direct = Schedule(dataflow="direct", num_chunks=3)
  assert _ran(_compiled(direct)) == _permutes(direct)


def test_autotune_writes_an_entry_the_next_call_uses(user_cache):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(0)
  x = util.rand(rng, (4 * X_LOCAL[0], X_LOCAL[1]), np.float32)
  w = util.rand(rng, (W_LOCAL[0], 4 * W_LOCAL[1]), np.float32)
  bad = Schedule(dataflow="ring", num_chunks=4)  # 4 does not divide 6.
  cands = [NONE, RING, Schedule(dataflow="direct", num_chunks=2), bad]
  res = ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh,
                           axis_name="x", candidates=cands, warmup=1,
                           rounds=2, iters=2)
  assert res.key == _key()
  assert {label for label, _ in res.timings_ms} == {
      s.short() for s in cands[:3]}
  assert [label for label, _ in res.errors] == [bad.short()]
  assert res.best == Schedule(**json.loads(user_cache.read_text())
                              ["entries"][0]["schedule"])
  assert res.timings_ms[0][0] == res.best.short()
  expected = "none" if res.best == NONE else _permutes(res.best)
  assert _ran(_compiled()) == expected
  # Force a different winner through the cache: the next trace follows it.
  other = RING if res.best != RING else NONE
  autotune_cache.store(res.key, other)
  assert _ran(_compiled()) == ("none" if other == NONE else _permutes(other))


def test_mixed_dtypes_are_keyed_as_the_op_looks_them_up(user_cache):
  """bf16 activations with f32 weights: the op promotes to f32 before it
  resolves its schedule, so autotune keys the entry float32, and the next
  trace runs it."""
  del user_cache
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(2)
  x = util.rand(rng, (4 * X_LOCAL[0], X_LOCAL[1]), jnp.bfloat16)
  w = util.rand(rng, (W_LOCAL[0], 4 * W_LOCAL[1]), np.float32)
  res = ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh,
                           axis_name="x", candidates=[RING], warmup=1,
                           rounds=1, iters=1)
  assert res.key == _key(dtype=np.float32)
  assert ficco_jax.choose_schedule(
      "all_gather_matmul", x_shape=X_LOCAL, w_shape=W_LOCAL,
      dtype=jnp.result_type(x, w), axis_size=4) == RING
  assert _ran(_compiled()) == _permutes(RING)


def test_an_operand_sharded_over_another_axis_is_refused(user_cache):
  """x sharded over "dp" as well: autotune would time, and key, a problem
  the model never runs, so it says how to tune it instead."""
  del user_cache
  mesh = util.mesh((2, 4), ("dp", "x"))
  x = jax.device_put(np.ones((8, 24, 10), np.float32),
                     NamedSharding(mesh, P("dp", "x")))
  w = np.ones((10, 28), np.float32)
  with pytest.raises(ValueError, match=r"sharded over \['dp'\] besides 'x'"
                     r".*ficco_jax.autotune_model"):
    ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh, axis_name="x",
                       axis=1, candidates=[RING], store=False)


def test_autotune_result_is_correct_op_output():
  # The cached schedule runs the same numbers as the reference.
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(1)
  x = util.rand(rng, (24, 10), np.float32)
  w = util.rand(rng, (10, 28), np.float32)
  ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh, axis_name="x",
                     candidates=[RING], warmup=1, rounds=1, iters=1)
  out = ficco_jax.sharded.all_gather_matmul(x, w, mesh=mesh, axis_name="x")
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(
      np.float32)


def test_autotune_reduce_scatter_key_uses_local_shapes():
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(2)
  h = util.rand(rng, (24, 40), np.float32)
  w = util.rand(rng, (40, 9), np.float32)
  res = ficco_jax.autotune("matmul_reduce_scatter", h, w, mesh=mesh,
                           axis_name="x", candidates=[NONE, RING],
                           warmup=1, rounds=1, iters=1, store=False)
  assert res.key.x_shape == (24, 10) and res.key.w_shape == (10, 9)
  assert res.cache_file is None
  assert autotune_cache.lookup(res.key) is None


def test_autotune_with_no_working_candidate_raises():
  mesh = util.mesh((4,), ("x",))
  x = np.ones((24, 10), np.float32)
  w = np.ones((10, 28), np.float32)
  with pytest.raises(RuntimeError, match="no candidate ran"):
    ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh, axis_name="x",
                       candidates=[Schedule(dataflow="ring", num_chunks=4)],
                       warmup=1, rounds=1, iters=1)


def test_shipped_h200_cache_is_what_schedule_none_uses(tmp_path):
  """Every entry shipped for the H200 resolves, for its own shapes, to itself."""
  import json
  import pathlib
  from ficco_jax._src import resolve as resolve_lib
  path = (pathlib.Path(ficco_jax.__file__).parent / "data" / "autotune" /
          "nvidia_h200.json")
  entries = json.loads(path.read_text())["entries"]
  assert entries, "the shipped H200 cache is empty"
  ficco_jax.set_autotune_cache(tmp_path / "empty.json")
  try:
    for e in entries:
      k = e["key"]
      r = resolve_lib.default_schedule(
          k["op"], x_shape=tuple(k["x_shape"]), w_shape=tuple(k["w_shape"]),
          dtype=k["dtype"], axis_size=k["axis_size"], axis=k["axis"],
          device_kind=k["device_kind"])
      got, source = r.schedule, r.source
      assert source == "autotune cache", k
      assert got == autotune_cache.schedule_from_json(e["schedule"]), k
      # The shipped winner is never slower than XLA's collective + dot.
      t = e["timings_ms"]
      assert t[got.short()] <= t["none/c1/xla/xla"], (k, t)
  finally:
    ficco_jax.set_autotune_cache(None)


def test_rank3_operand_with_unit_leading_dims_uses_the_2d_entry():
  """A sequence-parallel [1, S/P, d] shard resolves through the [S/P, d] entry
  (the same dots and bytes), only where its chunk count divides the axis."""
  from ficco_jax._src import resolve as resolve_lib
  kind = util.test_devices()[0].device_kind
  autotune_cache.store(_key(x_shape=(12, 10)), RING)
  autotune_cache.store(_key(x_shape=(24, 10)),
                       Schedule(dataflow="direct", num_chunks=8))

  def resolve(x_shape, axis):
    r = resolve_lib.default_schedule(
        "all_gather_matmul", x_shape=x_shape, w_shape=W_LOCAL,
        dtype=np.float32, axis_size=4, axis=axis, device_kind=kind)
    return r.schedule, r.source

  assert resolve((1, 12, 10), 1) == (RING, "autotune cache")
  assert resolve((12, 1, 10), 0) == (RING, "autotune cache")
  # Not a free fold: a leading dim > 1 before the axis.
  assert resolve((2, 6, 10), 1)[1] == "heuristic"
  # The 2-D entry cuts its 24 rows in 8; this op can cut only its 3 rows
  # along the axis (each 8 rows of the fold), so it does not fit.
  assert resolve((3, 8, 10), 0)[1] == "heuristic"
  assert resolve((8, 3, 10), 0)[0].num_chunks == 8


def test_entries_are_keyed_by_the_process_layout(monkeypatch, caplog):
  """A result measured in one process does not stand for a job of several
  (the copy engines run another transport there), and the reverse; the
  heuristic that answers instead says so."""
  from ficco_jax._src import resolve as resolve_lib
  from ficco_jax._src.tuning import heuristics
  kind = util.test_devices()[0].device_kind
  autotune_cache.store(_key(), RING)
  key2 = autotune_cache.Key.of(
      "all_gather_matmul", device_kind=kind, axis_size=4, x_shape=X_LOCAL,
      w_shape=W_LOCAL, axis=0, dtype=np.float32, processes=2)
  assert autotune_cache.Key.from_json(key2.to_json()) == key2
  assert "processes" not in _key().to_json()  # Shipped files stay as they are.

  def resolve():
    r = resolve_lib.default_schedule(
        "all_gather_matmul", x_shape=X_LOCAL, w_shape=W_LOCAL,
        dtype=np.float32, axis_size=4, axis=0, device_kind=kind)
    return r.schedule, r.source

  assert resolve() == (RING, "autotune cache")
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  heuristics.warn_once.cache_clear()
  with caplog.at_level("WARNING", logger="ficco_jax"):
    assert resolve()[1] == "heuristic"
  assert "job of 2 processes" in caplog.text
  direct = Schedule(dataflow="direct", num_chunks=2)
  autotune_cache.store(key2, direct)
  assert resolve() == (direct, "autotune cache")


class _FakeDevice:
  """Stands in for a jax device in the candidate choice (no GPU here)."""

  def __init__(self, platform="gpu", compute_capability="9.0"):
    self.platform = platform
    self.compute_capability = compute_capability


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_default_candidates_add_the_hopper_kernel_where_it_runs(monkeypatch,
                                                                op):
  # The shipped H200 cache holds Pallas and flagged schedules, so a user's
  # autotune must time them too where ficco's kernel runs (sm_90, 2-byte
  # operands, copy engines available), and never elsewhere.
  from ficco_jax._src.tuning import autotune as autotune_lib
  from ficco_jax._src.tuning import heuristics
  monkeypatch.setattr(heuristics, "dma_available", lambda platform: True)
  args = (op, (4096, 3584), (3584, 4096), jax.numpy.bfloat16, 4, 0, "gpu")
  hopper = autotune_lib._default_candidates(*args, _FakeDevice())
  labels = {s.short() for s in hopper}
  assert "direct/c1/dma/pallas" in labels and "ring/c2/dma/pallas" in labels
  assert ("direct/c2/dma/pallas/step" in labels) == (
      op == "matmul_reduce_scatter")  # The shipped llama3-70b pick.
  # Each op's flagged kernel: the reduce-scatter's signalling one, the
  # signalled all-gather's waiting one.
  assert "direct/c1/dma/pallas/flagged" in labels
  # The push all-gather, wherever the copy engines are.
  assert ("direct/c1/dma/xla/flagged" in labels) == (op == "all_gather_matmul")
  assert not any("pallas" in l and "/c4/" in l for l in labels)
  assert not any(s.compute == "pallas" and s.comm == "xla" for s in hopper)
  base = autotune_lib._default_candidates(*args)  # No device: none added.
  assert not any(s.compute == "pallas" for s in base)
  assert set(base) < set(hopper)
  for device, dtype in ((_FakeDevice(compute_capability="8.0"), args[3]),
                        (_FakeDevice(compute_capability="10.0"), args[3]),
                        (_FakeDevice(), np.float32),
                        (_FakeDevice(platform="cpu"), args[3])):
    got = autotune_lib._default_candidates(*args[:3], dtype, *args[4:], device)
    assert not any(s.compute == "pallas" for s in got), (device.__dict__, dtype)


def _fixed_medians(monkeypatch, by_label):
  """autotune's timing replaced by fixed medians per schedule label."""
  from ficco_jax._src.tuning import autotune as autotune_lib
  order = []

  def fake(fns, args, *, rounds, iters):
    del fns, args, rounds, iters
    return [by_label[label] for label in order], {}

  real_warm = autotune_lib.warm

  def warm(fn, args, warmup):
    real_warm(fn, args, warmup)
    order.append(fn.__wrapped__.keywords["schedule"].short())
  monkeypatch.setattr(autotune_lib, "time_interleaved", fake)
  monkeypatch.setattr(autotune_lib, "warm", warm)


@pytest.mark.parametrize("margin, expected", [(0.0, "ring"), (0.01, "ring"),
                                              (0.03, "none")])
def test_autotune_margin_keeps_xla_program(monkeypatch, margin, expected):
  # The ring is 2% faster than "none": kept below a 2% margin, not above.
  mesh = util.mesh((4,), ("x",))
  x = np.ones((24, 10), np.float32)
  w = np.ones((10, 28), np.float32)
  # "none" under another engine is still XLA's own program.
  none_dma = Schedule(dataflow="none", comm="dma")
  _fixed_medians(monkeypatch, {RING.short(): 1.00, none_dma.short(): 1.02})
  res = ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh,
                           axis_name="x", candidates=[RING, none_dma],
                           store=False, margin=margin)
  assert res.best == (RING if expected == "ring" else none_dma)
  assert [label for label, _ in res.timings_ms] == [RING.short(),
                                                    none_dma.short()]


@pytest.mark.parametrize("kw", [dict(margin=-0.1), dict(margin=1.0),
                                dict(margin=True), dict(margin="0.1"),
                                dict(rounds=0), dict(iters=0),
                                dict(warmup=-1), dict(rounds=1.5)])
def test_autotune_rejects_bad_timing_arguments(kw):
  mesh = util.mesh((4,), ("x",))
  x = np.ones((24, 10), np.float32)
  w = np.ones((10, 28), np.float32)
  name = next(iter(kw))
  with pytest.raises(ValueError, match=name):
    ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh, axis_name="x",
                       candidates=[NONE], **kw)


def test_autotune_accepts_numpy_margin():
  mesh = util.mesh((4,), ("x",))
  x = np.ones((24, 10), np.float32)
  w = np.ones((10, 28), np.float32)
  res = ficco_jax.autotune("all_gather_matmul", x, w, mesh=mesh,
                           axis_name="x", candidates=[NONE], warmup=1,
                           rounds=1, iters=1, store=False,
                           margin=np.float32(0.03))
  assert res.best == NONE


def test_time_interleaved_rotates_candidates_each_round():
  from ficco_jax._src.tuning import autotune as autotune_lib
  calls = []

  def fake(i):
    def fn(*args):
      calls.append(i)
      return np.zeros(1)
    return fn

  medians, errors = autotune_lib.time_interleaved(
      [fake(0), fake(1), fake(2)], (), rounds=3, iters=2)
  assert len(medians) == 3 and not errors
  # Per round and candidate: one untimed call, then `iters` timed ones.
  blocks = [calls[k:k + 3] for k in range(0, len(calls), 3)]
  assert all(len(set(b)) == 1 for b in blocks)
  order = [b[0] for b in blocks]
  assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_time_interleaved_medians_belong_to_their_function():
  import time
  from ficco_jax._src.tuning import autotune as autotune_lib

  def sleeper(ms):
    def fn():
      time.sleep(ms / 1e3)
      return np.zeros(1)
    return fn

  medians, errors = autotune_lib.time_interleaved(
      [sleeper(6.0), sleeper(0.0)], (), rounds=4, iters=2)
  assert not errors
  assert medians[0] >= 5.0 and medians[1] < medians[0] - 3.0


def test_time_interleaved_drops_a_failing_function_and_goes_on():
  from ficco_jax._src.tuning import autotune as autotune_lib
  state = {"calls": 0}

  def flaky():
    state["calls"] += 1
    if state["calls"] > 2:
      raise RuntimeError("device lost")
    return np.zeros(1)

  ok = lambda: np.zeros(1)
  medians, errors = autotune_lib.time_interleaved([flaky, ok], (), rounds=3,
                                                  iters=1)
  assert medians[0] is None and medians[1] is not None
  assert list(errors) == [0] and "device lost" in errors[0]
  # Dropped after failing: 2 good calls, then the one that raised.
  assert state["calls"] == 3


DMA = Schedule(dataflow="direct", num_chunks=1, comm="dma")


def _sharded_calls(mesh):
  """An eager (un-jitted) sharded call and a jax.vmap'd one, schedule=None:
  neither can run the copy engines."""
  def eager(x, w):
    return ficco_jax.sharded.all_gather_matmul(x, w, mesh=mesh, axis_name="x")

  vmapped = jax.jit(jax.shard_map(
      jax.vmap(functools.partial(ficco_jax.all_gather_matmul, axis_name="x"),
               (0, None)),
      mesh=mesh, in_specs=(P(None, "x"), P(None, "x")),
      out_specs=P(None, None, "x")))
  return {"eager": eager, "vmap": vmapped}


@pytest.mark.parametrize("how", ["eager", "vmap"])
def test_a_copy_engine_entry_is_not_served_where_the_call_cannot_run_it(
    user_cache, caplog, how):
  """An entry a jitted call stored (the copy engines) is left out, with a
  warning, by a call that is not one compiled program: it runs, as it did
  before the tuning, instead of raising about a schedule it never asked
  for."""
  del user_cache
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(5)
  x = util.rand(rng, (4 * X_LOCAL[0], X_LOCAL[1]), np.float32)
  w = util.rand(rng, (W_LOCAL[0], 4 * W_LOCAL[1]), np.float32)
  autotune_cache.store(_key(), DMA)
  x_in, w_in = x, w
  if how == "vmap":
    x_in = jax.device_put(x[None].repeat(3, 0),
                          NamedSharding(mesh, P(None, "x")))
    w_in = jax.device_put(w, NamedSharding(mesh, P(None, "x")))
  with caplog.at_level("WARNING", logger="ficco_jax"):
    y = _sharded_calls(mesh)[how](x_in, w_in)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, *want.shape)[-1],
                             want, rtol=1e-5, atol=1e-5)
  assert f"the autotune cache's {DMA.short()} for these shapes cannot run" \
      " this call" in caplog.text, caplog.text
  # A jitted call (what choose_schedule plans for) still runs the entry.
  assert ficco_jax.choose_schedule(
      "all_gather_matmul", x_shape=X_LOCAL, w_shape=W_LOCAL,
      dtype=np.float32, axis_size=4) == DMA


@pytest.mark.parametrize("op, entry, why", [
    ("all_gather_matmul",
     Schedule(dataflow="direct", comm="dma", compute_granularity="halving"),
     "'halving' is the reduce-scatter's"),
    ("matmul_reduce_scatter",
     Schedule(dataflow="direct", comm="dma", compute_granularity="flagged"),
     "'flagged' needs compute='pallas'"),
], ids=["ag-halving", "rs-flagged-xla"])
def test_a_cache_entry_the_op_refuses_is_not_served(user_cache, caplog, op,
                                                   entry, why):
  """A valid Schedule the op itself refuses (a hand edit, another
  version's entry): choose_schedule and the op both take the heuristic's
  pick and agree, and the user is told why, instead of every call of the
  shape raising."""
  del user_cache
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(6)
  x_local = X_LOCAL if op == "all_gather_matmul" else (4 * X_LOCAL[0],
                                                       X_LOCAL[1])
  key = autotune_cache.Key.of(
      op, device_kind=util.test_devices()[0].device_kind, axis_size=4,
      x_shape=x_local, w_shape=W_LOCAL, axis=0, dtype=np.float32)
  autotune_cache.store(key, entry)
  with caplog.at_level("WARNING", logger="ficco_jax"):
    chosen = ficco_jax.choose_schedule(op, x_shape=x_local, w_shape=W_LOCAL,
                                       dtype=np.float32, axis_size=4)
    explained = ficco_jax.explain(op, x_shape=x_local, w_shape=W_LOCAL,
                                  dtype=np.float32, axis_size=4)
  assert chosen == explained.chosen != entry
  assert "cannot run this call" in explained.reason
  assert why in caplog.text and f"the autotune cache's {entry.short()}" in (
      caplog.text)
  if op == "all_gather_matmul":
    x = util.rand(rng, (4 * X_LOCAL[0], X_LOCAL[1]), np.float32)
    w = util.rand(rng, (W_LOCAL[0], 4 * W_LOCAL[1]), np.float32)
    y = jax.jit(functools.partial(ficco_jax.sharded.all_gather_matmul,
                                  mesh=mesh, axis_name="x"))(x, w)
  else:
    x = util.rand(rng, (x_local[0], 4 * x_local[1]), np.float32)
    w = util.rand(rng, (4 * W_LOCAL[0], W_LOCAL[1]), np.float32)
    y = jax.jit(functools.partial(ficco_jax.sharded.matmul_reduce_scatter,
                                  mesh=mesh, axis_name="x"))(x, w)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_an_eager_call_on_gpus_leaves_the_copy_engines_out_of_the_pick(
    caplog):
  """On a GPU kind the heuristic overlaps on the copy engines; for a call
  that is not one compiled program it ranks only what such a call runs,
  and says so."""
  from ficco_jax._src import resolve
  # A shape the shipped cache does not hold: the heuristic picks.
  args = dict(x_shape=(3072, 6144), w_shape=(6144, 5120), dtype=jnp.bfloat16,
              axis_size=4, device_kind="NVIDIA H200")
  jitted = resolve.default_schedule("all_gather_matmul", **args)
  assert jitted.source == "heuristic"
  assert jitted.schedule.comm == "dma" and jitted.schedule.overlapped
  with caplog.at_level("WARNING", logger="ficco_jax"):
    eager = resolve.default_schedule("all_gather_matmul",
                                     operand_kind="ShardMapTracer", **args)
  assert eager.schedule.comm == "xla"
  assert "must be traced under jax.jit" in eager.reason
  assert f"{jitted.schedule.short()}, cannot run this call" in caplog.text


def _entry_with(key=None, schedule=None):
  k = dict(_key().to_json(), **(key or {}))
  s = autotune_cache.schedule_to_json(RING) if schedule is None else schedule
  return json.dumps({"format": 1, "entries": [{"key": k, "schedule": s}]})


@pytest.mark.parametrize("text, says", [
    (_entry_with(key={"x_shape": "610"}), "x_shape='610' must be a list"),
    (_entry_with(key={"x_shape": [6.9, 10]}), "x_shape=[6.9, 10] must be a"),
    (_entry_with(key={"axis_size": True}), "axis_size=True must be an int"),
    (_entry_with(schedule={}), "a schedule is a JSON object with a dataflow"),
    (_entry_with(schedule=[["dataflow", "ring"]]), "is not a JSON object"),
    ('{"format": 1, "entries": [{"key": {"x_shape": [1e999]}}]}',
     "entry 0 is malformed"),
    ("[" * 100000 + "]" * 100000, "RecursionError"),
], ids=["shape-str", "shape-float", "bool", "empty-schedule", "pairs",
        "infinity", "deep"])
def test_a_cache_that_is_not_what_autotune_writes_is_ignored_not_misread(
    user_cache, caplog, text, says):
  """Each of these once crashed every schedule=None call or was read as
  another key or schedule (x_shape "610" as (6, 1, 0), an empty schedule as
  the overlapped default)."""
  user_cache.write_text(text)
  with caplog.at_level("WARNING", logger="ficco_jax"):
    assert autotune_cache.lookup(_key()) is None
    assert ficco_jax.choose_schedule(
        "all_gather_matmul", x_shape=X_LOCAL, w_shape=W_LOCAL,
        dtype=np.float32, axis_size=4) == NONE
  # The file, or that entry alone, left out, and the user told why.
  assert says in caplog.text, caplog.text
  assert str(user_cache) in caplog.text
