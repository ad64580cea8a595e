"""Flags every suite shares: output, budget, timing, cases.

A suite's own flags live in its module; `bench.py` imports every suite, so
``--helpfull`` lists them all.
"""

from __future__ import annotations

import re

from absl import flags

from lib import cases
from lib import timing

FLAGS = flags.FLAGS

flags.DEFINE_string("out_dir", None,
                    "Where results go (default:"
                    " benchmarks/results/<device_slug>_w<axis size>/).")
flags.DEFINE_float("time_budget_s", 0.0,
                   "Soft budget: no new case (or program) starts after this"
                   " many seconds; what was not run is listed as skipped."
                   " 0: none.")
flags.DEFINE_integer("processes", 1,
                     "ops, profile: run as this many JAX processes (python"
                     " -m ficco_jax.launch); process 0 writes the results.")
flags.DEFINE_integer("axis_size", None,
                     "W: devices on the mesh axis, the first W devices"
                     " (default: all).")

# Timing (lib/timing.py).
flags.DEFINE_integer("warmup", timing.WARMUP,
                     "Warm-up calls (the first compiles).")
flags.DEFINE_integer("rounds", timing.ROUNDS, "Timed rounds.")
flags.DEFINE_integer("iters", timing.ITERS,
                     "Back-to-back calls per round (at least).")
flags.DEFINE_float("min_round_ms", 25.0,
                   "Raise the calls per round of short ops until a round"
                   " lasts this long; 0: exactly --iters (CPU default).")
flags.DEFINE_float("settle_ms", 10.0,
                   "Interleaved timing: untimed calls of a program for this"
                   " long before each of its timed rounds (at least one;"
                   " CPU default 0).")
flags.DEFINE_enum("order", "shuffle", list(timing.ORDERS),
                  "Interleaved timing: each round in a fresh seeded random"
                  " order (shuffle) or one cyclic order rotated (rotate).")
flags.DEFINE_integer("input_sets", 2, "Random input sets calls rotate over.")

# Cases (lib/cases.py).
flags.DEFINE_string("shapes", cases.DEFAULT_SHAPES, "shapes.json path.")
flags.DEFINE_enum("preset", None, list(cases.PRESETS),
                  "A named case list; 'ten': llama3-8b, llama3-70b,"
                  " qwen2-72b, gpt3-175b x tokens 4096, 8192, plus the two"
                  " square cases; 'heldout': the drawn cases of"
                  " benchmarks/data/heldout_cases.json.")
flags.DEFINE_list("models", ["llama3-70b", "llama3-8b"],
                  "Models of shapes.json ('all': every model).")
flags.DEFINE_list("tokens", ["4096", "8192"], "Token counts M.")
flags.DEFINE_bool("square", True, "Also run shapes.json's square cases.")
flags.DEFINE_list("cases", [],
                  "Explicit cases [name:]MxKxN (global sizes), run first."
                  " Given alone (no --models/--preset), only these run.")
flags.DEFINE_string("case_filter", "",
                    "Only the cases whose name matches this regular"
                    " expression (re.search), e.g. 'heldout-(0[6-9]|1|2)'"
                    " for held-out cases 06-23.")
flags.DEFINE_bool("tiny", False,
                  "CPU smoke sizes: every model and token dimension divided"
                  " by 64.")


def configure_timing() -> dict:
  """Applies the timing flags to lib.timing; returns them for result files.

  On CPU devices --min_round_ms and --settle_ms default to 0: XLA's CPU
  collectives deadlock once a few hundred calls are queued (the device
  threads wait in rendezvous that queued calls never reach), and CPU
  timings are smoke runs anyway.
  """
  import jax  # pylint: disable=g-import-not-at-top
  cpu = jax.devices()[0].platform == "cpu"
  min_round_ms, settle_ms = FLAGS.min_round_ms, FLAGS.settle_ms
  if cpu and not FLAGS["min_round_ms"].present:
    min_round_ms = 0.0
  if cpu and not FLAGS["settle_ms"].present:
    settle_ms = 0.0
  timing.set_min_round_ms(min_round_ms)
  timing.set_settle_ms(settle_ms)
  timing.set_order(FLAGS.order)
  return {"warmup": FLAGS.warmup, "rounds": FLAGS.rounds,
          "iters": FLAGS.iters, "input_sets": FLAGS.input_sets,
          **timing.settings(),
          "stat": "median and min over rounds of round_time / iters"}


def timing_kwargs() -> dict:
  return dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)


def case_list(op: str) -> list[cases.Case]:
  """The cases the flags ask for, for ``op`` ("ag" or "rs")."""
  heldout = False
  if FLAGS.preset:
    p = cases.PRESETS[FLAGS.preset]
    models, tokens, square = p["models"], p["tokens"], p["square"]
    heldout = p.get("heldout", False)
  elif FLAGS.cases and not FLAGS["models"].present:
    models, tokens, square = [], [], False
  else:
    models, tokens, square = FLAGS.models, FLAGS.tokens, FLAGS.square
  out = cases.build(op, shapes_path=FLAGS.shapes, models=models,
                    tokens=tokens, square=square, extra=FLAGS.cases,
                    tiny=FLAGS.tiny, heldout_cases=heldout)
  if FLAGS.case_filter:
    kept = [c for c in out if re.search(FLAGS.case_filter, c.name)]
    if not kept:
      raise ValueError(
          f"--case_filter={FLAGS.case_filter!r} matches none of the"
          f" {len(out)} cases: {', '.join(c.name for c in out)}.")
    out = kept
  return out
