"""The held-out cases schedule=None is scored on: drawn, saved, untouched.

benchmarks/data/heldout_cases.json must be what its seed draws (so nobody
picked or edited cases), in the issue's ranges, and disjoint from
shapes.json's models (so nothing tuned or fitted there has seen them).
"""

import importlib.util
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cases_lib():
  spec = importlib.util.spec_from_file_location(
      "bench_cases", REPO / "benchmarks" / "lib" / "cases.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # Its dataclasses look their module up.
  spec.loader.exec_module(mod)
  return mod


def test_the_saved_cases_are_the_seeded_draw_and_disjoint():
  cases = _cases_lib()
  saved = json.loads(pathlib.Path(cases.HELDOUT).read_text())
  assert saved["cases"] == cases.draw_heldout(saved["seed"], saved["count"])
  shapes = json.loads(pathlib.Path(cases.DEFAULT_SHAPES).read_text())
  taken = {(m["H"], m["F"]) for m in shapes["models"].values()}
  for c in saved["cases"]:
    assert (c["H"], c["F"]) not in taken
    for key in ("H", "F", "tokens"):
      lo, hi, step = cases.HELDOUT_RANGES[key]
      assert lo <= c[key] <= hi and c[key] % step == 0, (key, c)
  assert len({(c["H"], c["F"], c["tokens"]) for c in saved["cases"]}) == len(
      saved["cases"])


def test_the_heldout_preset_runs_them_for_both_ops():
  cases = _cases_lib()
  saved = json.loads(pathlib.Path(cases.HELDOUT).read_text())["cases"]
  for op, dims in (("ag", ("H", "F")), ("rs", ("F", "H"))):
    built = cases.build(op, **{k: v for k, v in cases.PRESETS["heldout"].items()
                               if k != "heldout"},
                        heldout_cases=True)
    assert [(c.m, c.k, c.n) for c in built] == [
        (s["tokens"], s[dims[0]], s[dims[1]]) for s in saved]
    # Every case splits over 2, 4 and 8 devices.
    assert all(cases.divisible(op, c, w) is None for c in built
               for w in (2, 4, 8))


def test_choose_schedule_and_explain_agree_on_every_heldout_case():
  # schedule=None resolves through choose_schedule's order (the op traced
  # on the devices at hand does the same); explain must name that schedule
  # on every case it is scored on, for both ops, every axis size and both
  # GPU kinds with parameters.
  import ficco_jax  # pylint: disable=g-import-not-at-top
  cases = _cases_lib()
  for op, name in (("ag", "all_gather_matmul"),
                   ("rs", "matmul_reduce_scatter")):
    for c in cases.heldout(op):
      for w in (2, 4, 8):
        x, wt = cases.local_shapes(op, c, w)
        for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
          kw = dict(x_shape=x, w_shape=wt, dtype="bfloat16", axis_size=w,
                    device_kind=kind)
          e = ficco_jax.explain(name, **kw)
          assert e.chosen == ficco_jax.choose_schedule(name, **kw), (
              op, c, w, kind)
          assert e.source in ("autotune cache", "heuristic"), e.source
