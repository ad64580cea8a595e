"""ficco_jax.explain: the schedule schedule=None runs, where it came from, why."""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src.tuning import autotune_cache
from ficco_jax._src.tuning import heuristics

H200 = "NVIDIA H200"
BIG = dict(x_shape=(2048, 8192), w_shape=(8192, 7168), dtype="bfloat16",
           axis_size=4)


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
  # These tests are about the heuristic: the shipped H200 cache covers some
  # of their shapes, so it is left out here (test_autotune checks it).
  monkeypatch.setattr(autotune_cache, "_package", lambda device_kind: {})
  ficco_jax.set_autotune_cache(tmp_path / "autotune.json")
  yield
  ficco_jax.set_autotune_cache(None)


def test_large_op_on_h200_explains_an_overlapped_choice():
  e = ficco_jax.explain("all_gather_matmul", device_kind=H200, **BIG)
  assert e.source == "heuristic" and e.chosen.overlapped
  assert e.candidates[0].prediction.schedule == e.chosen
  assert e.candidates[0].verdict == "chosen"
  assert e.chosen_prediction.total < e.t_mm_s + e.t_comm_s
  assert e.ideal_s == max(e.t_mm_s, e.t_comm_s)
  # Every runner-up says by how much and why it lost.
  # Families the shipped calibration does not cover come last, unranked.
  # At P = 4 on H200 the model's pulled gather runs as the push all-gather
  # (DeviceParams.push_gather_at), its prediction standing for it.
  assert e.chosen == heuristics.PUSH_GATHER, e.chosen
  assert "push all-gather" in e.reason
  pulled = e.candidates[1]
  assert pulled.prediction.schedule == dataclasses.replace(
      e.chosen, compute_granularity=None)
  assert pulled.prediction.total == e.chosen_prediction.total
  assert pulled.verdict.startswith("the model's pick; the heuristic runs")
  for c in e.candidates[2:]:
    if c.verdict.startswith("not considered"):
      assert "never measured" in c.verdict
      continue
    assert c.verdict.startswith("+"), c.verdict
    assert c.prediction.total >= e.chosen_prediction.total
  text = str(e)
  assert e.chosen.short() in text and "T_mm" in text and "ideal" in text
  assert text.count("\n") >= len(e.candidates) + 4
  assert "heuristic" in text
  with pytest.raises(dataclasses.FrozenInstanceError):
    e.source = "x"


def test_same_choice_as_choose_schedule():
  for x in [(2048, 8192), (512, 8192), (4096, 4096)]:
    kw = dict(BIG, x_shape=x, w_shape=(x[1], 2048))
    e = ficco_jax.explain("all_gather_matmul", device_kind=H200, **kw)
    assert e.chosen == ficco_jax.choose_schedule(
        "all_gather_matmul", device_kind=H200, **kw)


def test_comm_bound_runner_up_names_its_links():
  # A tall contraction and few output columns: moving x dominates.
  e = ficco_jax.explain("all_gather_matmul", x_shape=(2048, 16384),
                        w_shape=(16384, 256), dtype="bfloat16", axis_size=4,
                        device_kind=H200)
  verdicts = [c.verdict for c in e.candidates]
  assert any("comm-bound, uses 1 of 3 links" in v for v in verdicts), verdicts


def test_tiny_op_is_not_overlapped_and_says_why():
  e = ficco_jax.explain("all_gather_matmul", x_shape=(6, 10), w_shape=(10, 7),
                        dtype=np.float32, axis_size=4, device_kind=H200)
  assert e.chosen == Schedule(dataflow="none")
  assert e.reason.startswith("tiny")
  overlapped = [c for c in e.candidates if c.prediction.schedule.overlapped]
  assert all(c.verdict.startswith("not considered (tiny")
             for c in overlapped)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="this checks the CPU host's own resolution")
def test_this_host_cpu_does_not_overlap():
  e = ficco_jax.explain("all_gather_matmul", **BIG)
  assert e.device_kind == "cpu" and not e.chosen.overlapped
  assert "platform 'cpu'" in e.reason


def test_cache_entry_is_reported_as_the_source():
  ring = Schedule(dataflow="ring", num_chunks=8, comm="dma")
  key = autotune_cache.Key.of("all_gather_matmul", device_kind=H200, axis=0,
                              **BIG)
  autotune_cache.store(key, ring)
  e = ficco_jax.explain("all_gather_matmul", device_kind=H200, **BIG)
  assert e.chosen == ring and e.source == "autotune cache"
  assert "measured fastest" in e.reason
  assert e.chosen_prediction.schedule == ring
  # Candidates the model prefers are not called losers.
  faster = [c for c in e.candidates
            if c.prediction.total < e.chosen_prediction.total]
  assert faster and all(c.verdict.startswith(("predicted no slower",
                                               "not considered (family"))
                        for c in faster)
  assert any(c.verdict.startswith("predicted no slower") for c in faster)


def test_reduce_scatter_is_explained(monkeypatch):
  kw = dict(x_shape=(8192, 7168), w_shape=(7168, 8192), dtype="bfloat16",
            axis_size=4, device_kind=H200)
  monkeypatch.setattr(heuristics, "OVERLAP_REDUCE_SCATTER", False)
  e = ficco_jax.explain("matmul_reduce_scatter", **kw)
  assert not e.chosen.overlapped
  assert "OVERLAP_REDUCE_SCATTER" in e.reason
  assert len(e.candidates) > 1


def test_unknown_op_is_rejected():
  with pytest.raises(ValueError, match="op='all_reduce_matmul' must be one"):
    ficco_jax.explain("all_reduce_matmul", **BIG)
  with pytest.raises(ValueError, match="op='all_reduce_matmul' must be one"):
    ficco_jax.choose_schedule("all_reduce_matmul", **BIG)
  # A MoE op's weights are one matrix per local expert.
  for fn in (ficco_jax.explain, ficco_jax.choose_schedule):
    with pytest.raises(ValueError, match=r"w_shape=\(.*\) must be"
                       r" \[E_l, d, f\]"):
      fn("all_to_all_matmul", **BIG)


@pytest.mark.parametrize("change, exc, match", [
    (dict(axis_size=0), ValueError, r"axis_size=0 must be an int >= 1"),
    (dict(dtype=np.int32), TypeError,
     r"dtype=.*int32.* must be float16, bfloat16, float32 or float64"),
    (dict(x_shape=(2048, 0), w_shape=(0, 7168)), ValueError,
     r"every dimension must be at least 1"),
    (dict(op="matmul_reduce_scatter", x_shape=(2050, 8192)), ValueError,
     r"x_shape\[0\] \(2050\) must be divisible by axis_size \(4\)"),
    (dict(w_shape=(4096, 8192)), ValueError,
     r"expected x \[..., rows, ..., k\] and w \[k, n\] with equal"
     r" contraction sizes"),
    (dict(axis=1), ValueError, r"axis=1 is invalid for an operand of shape"
     r" \(2048, 8192\): it must name one of its first 1 axes \(the last axis"
     r" is the contraction\)"),
    (dict(op="all_to_all_matmul", x_shape=(4096, 1024),
          w_shape=(4, 2048, 1408)), ValueError,
     r"w_shape=\(4, 2048, 1408\) must be \[E_l, d, f\].*x_shape=\(4096,"
     r" 1024\)"),
])
def test_calls_the_op_would_refuse_are_refused(change, exc, match):
  """choose_schedule and explain plan no call that cannot run."""
  kw = dict(BIG, **change)
  op = kw.pop("op", "all_gather_matmul")
  for fn in (ficco_jax.explain, ficco_jax.choose_schedule):
    with pytest.raises(exc, match=match):
      fn(op, **kw)


def test_a_negative_axis_plans_as_the_op_runs(user_cache):
  """The op keys the autotune cache by its normalized axis: so must
  choose_schedule, whatever sign the caller gives."""
  del user_cache
  ring = ficco_jax.Schedule(dataflow="ring", num_chunks=2)
  key = autotune_cache.Key.of(
      "all_gather_matmul", device_kind=jax.devices()[0].device_kind,
      axis_size=4, x_shape=(2, 8, 16), w_shape=(16, 8), axis=1,
      dtype=np.float32)
  autotune_cache.store(key, ring)
  for axis in (1, -2):
    assert ficco_jax.choose_schedule(
        "all_gather_matmul", x_shape=(2, 8, 16), w_shape=(16, 8),
        dtype=np.float32, axis_size=4, axis=axis) == ring


def _shipped_entries():
  """Every entry of every autotune cache the package ships."""
  data = pathlib.Path(ficco_jax.__file__).parent / "data" / "autotune"
  files = sorted(data.glob("*.json"))
  assert files, f"no shipped autotune cache under {data}"
  return [(f.name, e) for f in files
          for e in json.loads(f.read_text())["entries"]]


@pytest.mark.parametrize("name,entry", _shipped_entries(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_every_shipped_cache_entry_is_explained(monkeypatch, name, entry):
  """explain, choose_schedule and schedule=None's resolution agree on every
  shipped entry, from a machine of another kind (this one)."""
  del name
  monkeypatch.undo()  # The shipped caches are the point here.
  ficco_jax.set_autotune_cache(None)
  k = entry["key"]
  kw = dict(x_shape=tuple(k["x_shape"]), w_shape=tuple(k["w_shape"]),
            dtype=k["dtype"], axis_size=k["axis_size"], axis=k["axis"],
            device_kind=k["device_kind"])
  want = autotune_cache.schedule_from_json(entry["schedule"])
  e = ficco_jax.explain(k["op"], **kw)
  assert e.source == "autotune cache" and e.chosen == want, (k, e.chosen)
  assert ficco_jax.choose_schedule(k["op"], **kw) == want
  assert e.chosen.short() in str(e)
  if want.compute_granularity == "flagged":
    assert e.transport == "push"


def test_explain_and_choose_schedule_for_another_kind_plan_for_its_gpu():
  """Naming a device kind that is not this host's plans for that GPU (copy
  engines and all), the same in both."""
  kw = dict(x_shape=(4096, 2048), w_shape=(2048, 8192), dtype="bfloat16",
            axis_size=4, device_kind=H200)
  e = ficco_jax.explain("matmul_reduce_scatter", **kw)
  assert "platform" not in e.reason
  assert e.chosen == ficco_jax.choose_schedule("matmul_reduce_scatter", **kw)


def test_an_axis_across_processes_gathers_by_push(monkeypatch):
  # The all-gather's direct/c1 on the copy engines, across processes, runs
  # as the push all-gather (no staging copy); in one process it does not;
  # explain and choose_schedule agree either way.
  kw = dict(x_shape=(4096, 4096), w_shape=(4096, 7168), dtype="bfloat16",
            axis_size=2)
  one = ficco_jax.choose_schedule("all_gather_matmul", device_kind=H200, **kw)
  assert one.dataflow == "direct" and one.num_chunks == 1 and one.comm == "dma"
  assert one.compute_granularity != "flagged"
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  two = ficco_jax.choose_schedule("all_gather_matmul", device_kind=H200, **kw)
  assert two == heuristics.PUSH_GATHER
  e = ficco_jax.explain("all_gather_matmul", device_kind=H200, **kw)
  assert e.chosen == two and "push all-gather" in e.reason
  assert e.candidates[0].prediction.schedule == two
  assert e.candidates[1].verdict.startswith("the model's pick")


def test_explain_reports_the_axis_as_the_op_keys_it():
  e = ficco_jax.explain("all_gather_matmul", x_shape=(2, 6, 10),
                        w_shape=(10, 7), dtype=np.float32, axis_size=4,
                        axis=-2)
  assert e.axis == 1
  assert e.chosen == ficco_jax.choose_schedule(
      "all_gather_matmul", x_shape=(2, 6, 10), w_shape=(10, 7),
      dtype=np.float32, axis_size=4, axis=1)
