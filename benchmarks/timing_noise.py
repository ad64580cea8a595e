"""How far the timing method reads one program against itself, by round length.

The "never slower" check compares ficco's op with XLA's collective + dot. Where
``schedule=None`` is ``"none"`` ficco runs XLA's own program, yet in session 5
it read 0.83-0.92x of the baseline on the first, short case (0.3 ms) of a
call. This times, interleaved in one process (`timing.interleaved`), two
separately jitted copies of XLA's matmul + reduce-scatter (``xla_a``,
``xla_b``), ficco's ``none``, the ``--schedules`` and, registered just
before ``xla_a``, a light program (the collective alone, ``comm``), as
rs_bench's baseline followed one in session 6. Every ``--round_settings``
value (0: exactly ``--iters`` calls per round; else rounds stretched to
last that many ms) runs under every ``--harnesses`` order (``rotate``:
session 6's cyclic order, one untimed call before a block; ``shuffle``: a
random order per round and ``--settle_ms`` of untimed calls before a
block), each ``--passes`` times. It reports each program's median, its
round spread (max / min round) and the ratios ``xla_a / xla_b`` and
``xla_a / none``: 1.0 is the truth for both.

  python benchmarks/timing_noise.py --m=4096 --k=14336 --n=4096 \
      --axis_size=4 --round_settings=0,25 --harnesses=rotate,shuffle \
      --rounds=9 --out=noise.json
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
# --schedules, --rounds, --iters, --warmup, --input_sets: common's flags.
common.define_flags(default_peers="")
_M = flags.DEFINE_integer("m", 4096, "Global rows M.")
_K = flags.DEFINE_integer("k", 14336, "Global K (the contraction).")
_N = flags.DEFINE_integer("n", 4096, "N.")
_W = flags.DEFINE_integer("axis_size", 4, "Devices on the axis.")
_SETTINGS = flags.DEFINE_list("round_settings", ["0", "25"],
                              "min_round_ms values to compare (0: exactly"
                              " --iters calls per round).")
_HARNESSES = flags.DEFINE_list(
    "harnesses", ["shuffle"],
    "Interleaved orders to compare: rotate (session 6: cyclic order, one"
    " untimed call before a block) and/or shuffle (random order per round,"
    " --settle_ms of untimed calls before a block).")
_PASSES = flags.DEFINE_integer("passes", 2, "Repeats of every setting.")
_OUT = flags.DEFINE_string("out", "timing_noise.json", "Output JSON path.")


def _programs(mesh, w):
  from jax import lax
  from jax.sharding import PartitionSpec as P
  import ficco_jax

  in_specs, out_spec = (P(None, "x"), P("x", None)), P("x", None)

  def xla(a, b):
    return lax.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True)

  def ficco(schedule):
    return functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                             schedule=schedule)

  progs = {
      # A light program first, so that in the rotate order xla_a follows it
      # in most rounds, as rs_bench's baseline followed the collective alone
      # in session 6 (its own arguments: the partial's shape).
      "comm": common.jit_shard_map(
          lambda y: lax.psum_scatter(y, "x", scatter_dimension=0, tiled=True),
          mesh, P("x", None), P("x", None)),
      # Two jits of one body: two executables of the same program.
      "xla_a": common.jit_shard_map(xla, mesh, in_specs, out_spec),
      "xla_b": common.jit_shard_map(lambda a, b: xla(a, b), mesh, in_specs,
                                    out_spec),
      "none": common.jit_shard_map(
          ficco(ficco_jax.Schedule(dataflow="none")), mesh, in_specs,
          out_spec),
  }
  for label in FLAGS.schedules:
    progs[label] = common.jit_shard_map(
        ficco(common.schedule_from_label(label)), mesh, in_specs, out_spec)
  return progs


def _summary(res: dict) -> dict:
  rounds = res.get("rounds_ms") or []
  return {"median_ms": res.get("median_ms"), "iters": res.get("iters"),
          "spread": (max(rounds) / min(rounds)) if rounds else None,
          "rounds_ms": rounds, "error": res.get("error")}


def main(argv):
  del argv
  from jax.sharding import PartitionSpec as P

  w = _W.value
  mesh = common.mesh_of(w)
  m, k, n = _M.value, _K.value, _N.value
  sets = max(1, FLAGS.input_sets)
  args = [(common.random_array(mesh, (m, k), P(None, "x"), 10 * i + 1),
           common.random_array(mesh, (k, n), P("x", None), 10 * i + 2))
          for i in range(sets)]
  comm_args = [(common.random_array(mesh, (w * m, n), P("x", None),
                                    10 * i + 3),) for i in range(sets)]
  progs = _programs(mesh, w)
  out = {"env": common.env_info("timing_noise"), "shape": [m, k, n],
         "axis_size": w, "runs": []}
  for p in range(_PASSES.value):
    for setting, harness in [(s_, h) for s_ in _SETTINGS.value
                             for h in _HARNESSES.value]:
      timing.set_min_round_ms(float(setting))
      timing.set_order(harness)
      timing.set_settle_ms(FLAGS.settle_ms if harness == "shuffle" else 0.0)
      results = {}
      with timing.interleaved(True):
        for name, fn in progs.items():
          results[name] = timing.time_jax(
              fn, comm_args if name == "comm" else args, warmup=FLAGS.warmup, rounds=FLAGS.rounds,
              iters=FLAGS.iters)
      run = {"pass": p, "min_round_ms": float(setting), "harness": harness,
             "settle_ms": timing.settings()["settle_ms"],
             "programs": {k_: _summary(v) for k_, v in results.items()}}
      med = {k_: v["median_ms"] for k_, v in run["programs"].items()}
      if med.get("xla_a") and med.get("xla_b") and med.get("none"):
        run["xla_a_over_xla_b"] = med["xla_a"] / med["xla_b"]
        run["xla_a_over_none"] = med["xla_a"] / med["none"]
      out["runs"].append(run)
      spreads = {k_: v["spread"] for k_, v in run["programs"].items()}
      print(f"pass {p} min_round_ms={setting} {harness}: medians "
            + ", ".join(f"{k_} {v:.4f}" for k_, v in med.items() if v)
            + f" | xla_a/xla_b {run.get('xla_a_over_xla_b', 0):.3f}"
            f" xla_a/none {run.get('xla_a_over_none', 0):.3f} | spreads "
            + ", ".join(f"{k_} {v:.2f}" for k_, v in spreads.items() if v)
            + f" | iters {run['programs']['xla_a']['iters']}", flush=True)
  timing.set_min_round_ms(0.0)
  by_setting: dict[str, list[float]] = {}
  for r in out["runs"]:
    if "xla_a_over_none" in r:
      key = f"{r['min_round_ms']:g} ms {r['harness']}"
      by_setting.setdefault(key, []).extend(
          [abs(1 - r["xla_a_over_xla_b"]), abs(1 - r["xla_a_over_none"])])
  out["worst_self_error"] = {k_: max(v) for k_, v in by_setting.items()}
  out["median_self_error"] = {k_: statistics.median(v)
                              for k_, v in by_setting.items()}
  print("worst |1 - ratio| of a program against itself, by setting:",
        out["worst_self_error"], flush=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
