"""The benchmark tooling the committed GPU evidence relies on.

`benchmarks/timing.py`'s interleaved mode (results filled in place after the
round-robin), `benchmarks/profile_summary.py` (stream busy time, gaps,
copy overlap and host self time read from a perfetto trace),
`benchmarks/autotune_shapes.py`'s rule for what enters the shipped cache, and
`common.parse_cases` (the probes' `--cases`).
"""

import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import common  # noqa: E402  pylint: disable=g-import-not-at-top
import profile_summary  # noqa: E402  pylint: disable=g-import-not-at-top
import timing  # noqa: E402  pylint: disable=g-import-not-at-top


def test_interleaved_fills_the_returned_dicts_on_exit():
  f = jax.jit(lambda x: x @ x)
  g = jax.jit(lambda x: jnp.sin(x).sum())
  x = jnp.ones((64, 64))
  with timing.interleaved():
    rf = timing.time_jax(f, [(x,)], warmup=1, rounds=3, iters=2)
    rg = timing.time_jax(g, [(x,)], warmup=1, rounds=2, iters=2)
    # Compiled and warmed up, not timed yet.
    assert rf["interleaved"] and "median_ms" not in rf
    assert rf["compile_and_first_call_s"] > 0
  assert rf["rounds"] == 3 and len(rf["rounds_ms"]) == 3
  assert rg["rounds"] == 2 and len(rg["rounds_ms"]) == 2
  for r in (rf, rg):
    assert 0 < r["min_ms"] <= r["median_ms"]


def test_iters_for_stretches_short_rounds_only():
  assert timing.iters_for(0.3, 20, 25.0) == 84  # ceil(25 / 0.3)
  assert timing.iters_for(2.0, 20, 25.0) == 20  # 40 ms rounds already.
  assert timing.iters_for(1e-6, 20, 25.0) == timing.MAX_ITERS
  assert timing.iters_for(0.3, 20, 0.0) == 20
  with pytest.raises(ValueError, match="min_round_ms=-1"):
    timing.set_min_round_ms(-1)


@pytest.mark.parametrize("interleave", [False, True])
def test_min_round_ms_raises_the_calls_per_round(interleave):
  f = jax.jit(lambda x: x + 1)
  x = jnp.ones((4,))
  try:
    timing.set_min_round_ms(5.0)
    with timing.interleaved(interleave):
      r = timing.time_jax(f, [(x,)], warmup=1, rounds=2, iters=2)
  finally:
    timing.set_min_round_ms(0.0)
  # A tiny op takes far less than 2.5 ms per call on any host, so 2 calls
  # cannot fill 5 ms. (How long the stretched rounds then last depends on
  # the one timed batch the estimate comes from, noisy on a busy host.)
  assert 2 < r["iters"] <= timing.MAX_ITERS and r["rounds"] == 2


def test_round_order_shuffles_predecessors_and_is_repeatable():
  try:
    timing.set_order("rotate")
    # The session-6 order: every candidate keeps its predecessor.
    assert [timing.round_order(4, r) for r in range(2)] == [[0, 1, 2, 3],
                                                             [1, 2, 3, 0]]
    timing.set_order("shuffle")
    orders = [timing.round_order(5, r) for r in range(12)]
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert orders == [timing.round_order(5, r) for r in range(12)]
    # Candidate 1 follows more than one program across the rounds.
    before_1 = {o[o.index(1) - 1] for o in orders if o.index(1) > 0}
    assert len(before_1) > 1
    with pytest.raises(ValueError, match="order='cyclic'"):
      timing.set_order("cyclic")
  finally:
    timing.set_order("shuffle")


def test_settle_calls_cover_settle_ms():
  try:
    timing.set_settle_ms(10.0)
    assert timing.settle_calls(0.3) == 34  # ceil(10 / 0.3)
    assert timing.settle_calls(50.0) == 1
    assert timing.settle_calls(0.0) == 1
    timing.set_settle_ms(0.0)
    assert timing.settle_calls(0.3) == 1  # The session-6 harness: one call.
    with pytest.raises(ValueError, match="settle_ms=-2"):
      timing.set_settle_ms(-2)
  finally:
    timing.set_settle_ms(10.0)


def test_interleaved_settles_each_block_and_can_time_at_once():
  calls = {"f": 0}

  def f(x):
    calls["f"] += 1
    return x + 1

  g = jax.jit(lambda x: x * 2)
  x = jnp.ones((4,))
  try:
    timing.set_settle_ms(1e6)  # Capped at MAX_ITERS calls: count them.
    with timing.interleaved():
      rf = timing.time_jax(f, [(x,)], warmup=1, rounds=2, iters=3)
      after_registration = calls["f"]
      rg = timing.time_jax(g, [(x,)], warmup=1, rounds=2, iters=3,
                           interleave=False)
      # Timed at once: light reference programs stay out of the rounds.
      assert rg["rounds"] == 2 and "interleaved" not in rg
  finally:
    timing.set_settle_ms(10.0)
  assert rf["settle_calls"] == timing.MAX_ITERS
  # Each of the 2 rounds: MAX_ITERS untimed calls, then 3 timed ones.
  assert calls["f"] - after_registration == 2 * (timing.MAX_ITERS + 3)


def test_interleaved_records_a_failure_and_keeps_timing_the_others():
  failing = {"on": False}

  def flaky(x):
    if failing["on"]:  # Registered (compiled, warmed up); timed calls fail.
      raise RuntimeError("boom")
    return x + 1

  ok = jax.jit(lambda x: x * 2)
  x = jnp.ones((8,))
  with timing.interleaved():
    bad = timing.time_jax(flaky, [(x,)], warmup=2, rounds=2, iters=1)
    good = timing.time_jax(ok, [(x,)], warmup=1, rounds=2, iters=1)
    failing["on"] = True
  assert "boom" in bad["error"] and "median_ms" not in bad
  assert good["rounds"] == 2


def test_interleaved_off_and_nested_are_sequential():
  f = jax.jit(lambda x: x + 1)
  x = jnp.ones((4,))
  with timing.interleaved(enabled=False):
    r = timing.time_jax(f, [(x,)], warmup=1, rounds=2, iters=1)
  assert r["rounds"] == 2
  with timing.interleaved():
    with timing.interleaved():  # The inner block joins the outer one.
      inner = timing.time_jax(f, [(x,)], warmup=1, rounds=2, iters=1)
    assert "median_ms" not in inner
  assert inner["rounds"] == 2


def _trace(tmp_path, events):
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  return str(tmp_path)


def _meta(pid, name, threads):
  out = [{"ph": "M", "pid": pid, "name": "process_name",
          "args": {"name": name}}]
  out += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
           "args": {"name": tname}} for tid, tname in threads.items()]
  return out


def _x(pid, tid, name, ts, dur):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts,
          "dur": dur}


def test_profile_summary_streams_gaps_overlap_and_host_self_time(tmp_path):
  gpu = _meta(1, "/device:GPU:0", {10: "Stream #1(Compute)", 11: "Stream #2"})
  host = _meta(2, "/host:CPU", {20: "worker", 21: "worker"})
  events = gpu + host + [
      # Compute: gemm 0-100, gap 20, gemm 120-220 (2 calls of 110 us).
      _x(1, 10, "gemm", 0, 100), _x(1, 10, "sum", 120, 100),
      # A copy 50-150: 50 us under the first gemm, 20 in the gap, 30 under
      # the second.
      _x(1, 11, "MemcpyP2P", 50, 100),
      # Host: two threads with one name; thread 20 nests "inner" in "outer".
      _x(2, 20, "outer", 0, 100), _x(2, 20, "inner", 10, 30),
      _x(2, 21, "outer", 5, 50),
  ]
  text = profile_summary.summarize(
      profile_summary.load(_trace(tmp_path, events)), calls=2,
      timeline_events=0)
  assert "window 0.220 ms, 0.110 ms per call" in text
  assert "(compute): busy 0.100 ms/call" in text
  assert "copies off the compute stream: 0.050 ms/call, 80%" in text
  assert "compute stream idle (gaps > 3 us): 0.010 ms/call" in text
  assert "gemm -> sum" in text
  # Self time per thread (tid), even though both threads are "worker".
  assert "worker#20: total 0.050; outer 0.035 (0.5), inner 0.015 (0.5)" in text
  assert "worker#21: total 0.025; outer 0.025 (0.5)" in text


def test_profile_summary_needs_a_trace(tmp_path):
  with pytest.raises(FileNotFoundError, match="perfetto"):
    profile_summary.load(str(tmp_path))


def test_autotune_shapes_needs_a_win_over_xlas_faster_timing(tmp_path,
                                                              monkeypatch):
  """A case times XLA's program twice (the baseline, and "none"); a schedule
  enters the cache only if it beats the faster of the two by the margin."""
  import autotune_shapes  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ficco_jax._src import autotune_cache  # pylint: disable=g-import-not-at-top

  def case(name, baseline_ms, none_ms, ring_ms):
    method = lambda label, ms: {"method": "ficco", "label": label,
                                "median_ms": ms, "min_ms": ms}
    return {"name": name, "M": 4096, "K": 8192, "N": 8192, "W": 4,
            "baselines": {"xla": {"median_ms": baseline_ms,
                                  "min_ms": baseline_ms}},
            "methods": [method("none/c1/xla/xla", none_ms),
                        method("ring/c1/dma/xla", ring_ms),
                        method("direct/c1/dma/xla", 2.0)]}

  results = tmp_path / "rs.json"
  results.write_text(json.dumps({
      "meta": {"device_kind": "Test GPU"}, "op": "rs",
      # ring beats "none" by 8% but the baseline (the same program) is
      # faster than ring: not cached.
      "cases": [case("a/M4096", 1.0, 1.2, 1.1)]}))
  flags.FLAGS(["autotune_shapes", "--margin=0.03", "--keep=latest",
               "--min_schedules=2"])
  try:
    stored = []
    monkeypatch.setattr(autotune_cache, "store",
                        lambda key, schedule, **_: stored.append(schedule))
    autotune_shapes.from_results([str(results)], None)
    assert [s.dataflow for s in stored] == ["none"]
    # With the baseline as slow as "none", ring's 8% win counts.
    results.write_text(json.dumps({
        "meta": {"device_kind": "Test GPU"}, "op": "rs",
        "cases": [case("a/M4096", 1.2, 1.2, 1.1)]}))
    stored.clear()
    autotune_shapes.from_results([str(results)], None)
    assert [s.dataflow for s in stored] == ["ring"]
  finally:
    flags.FLAGS.unparse_flags()


def test_autotune_shapes_worst_keeps_what_wins_in_every_run(tmp_path,
                                                           monkeypatch):
  """--keep=worst: a schedule that won big in one run and lost in another
  (a host-bound op on a slower host) loses to one that won in both."""
  import autotune_shapes  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ficco_jax._src import autotune_cache  # pylint: disable=g-import-not-at-top

  def case(ring_ms, direct_ms):
    method = lambda label, ms: {"method": "ficco", "label": label,
                                "median_ms": ms, "min_ms": ms}
    return {"name": "a/M4096", "M": 4096, "K": 8192, "N": 8192, "W": 4,
            "baselines": {"xla": {"median_ms": 1.0, "min_ms": 1.0}},
            "methods": [method("none/c1/xla/xla", 1.0),
                        method("ring/c1/dma/xla", ring_ms),
                        method("direct/c1/dma/xla", direct_ms)]}

  paths = []
  for i, (ring, direct) in enumerate([(0.7, 0.9), (1.1, 0.92)]):
    paths.append(tmp_path / f"rs{i}.json")
    paths[-1].write_text(json.dumps({"meta": {"device_kind": "Test GPU"},
                                     "op": "rs", "cases": [case(ring, direct)]}))
  stored = []
  monkeypatch.setattr(autotune_cache, "store",
                      lambda key, schedule, **_: stored.append(schedule))
  try:
    flags.FLAGS(["autotune_shapes", "--margin=0.03", "--keep=latest",
                 "--min_schedules=2"])
    autotune_shapes.from_results([str(p) for p in paths], None)
    assert [s.dataflow for s in stored] == ["direct"]  # The last run only.
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["autotune_shapes", "--margin=0.03", "--keep=worst",
                 "--min_schedules=2"])
    stored.clear()
    autotune_shapes.from_results([str(paths[0])], None)
    assert [s.dataflow for s in stored] == ["ring"]  # One run: its best.
    stored.clear()
    autotune_shapes.from_results([str(p) for p in paths], None)
    assert [s.dataflow for s in stored] == ["direct"]  # 0.92 at worst.
    # Within the margin in one run: XLA's program.
    paths[1].write_text(json.dumps({"meta": {"device_kind": "Test GPU"},
                                    "op": "rs", "cases": [case(1.1, 0.99)]}))
    stored.clear()
    autotune_shapes.from_results([str(p) for p in paths], None)
    assert [s.dataflow for s in stored] == ["none"]
  finally:
    flags.FLAGS.unparse_flags()


def test_heuristic_accuracy_keeps_the_latest_run_of_a_case():
  import heuristic_accuracy  # pylint: disable=g-import-not-at-top

  def case(run, name, m):
    return heuristic_accuracy.Case(name=name, op="matmul_reduce_scatter",
                                   m=m, k=64, n=32, p=4, times=(), run=run)
  cases = [case("old", "a", 8), case("old", "b", 8), case("new", "a", 8),
           case("new", "a", 16)]
  kept = heuristic_accuracy.keep_latest(cases)
  assert [(c.run, c.name, c.m) for c in kept] == [
      ("old", "b", 8), ("new", "a", 8), ("new", "a", 16)]


def test_parse_cases_reads_named_and_bare_items():
  cases = common.parse_cases(["llama3-8b/M4096:4096x14336x4096", "6x10x7"])
  assert [(c.name, c.m, c.k, c.n) for c in cases] == [
      ("llama3-8b/M4096", 4096, 14336, 4096), ("6x10x7", 6, 10, 7)]
  for bad in ("4096x14336", "a:4096xKx4096", "square"):
    with pytest.raises(ValueError, match=repr(bad)):
      common.parse_cases([bad])

