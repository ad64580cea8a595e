"""Where a per-call program's host time goes, from jax's own profiler.

host_timeline.py sees ficco's handlers only; session 15 found that what moves
between slow and fast runs of the host-bound reduce-scatter is the rest of
the per-call path (Python's dispatch, PjRt's launch, the thunks between
ficco's), and session 18 that it is chosen once per process. This runs each
program (XLA's, the trivial one, ficco's labels) per call, times it
interleaved (timing.interleaved), then records ``--calls`` back-to-back calls
of each under ``jax.profiler`` (host tracer only; Python tracer off) and
reports, per program:

* the host period (intervals between Python's dispatches of consecutive
  calls) and, per thread, every TraceMe event's count per call, median
  length and time per call;
* per GPU stream (CUPTI, where the device tracer runs), each kernel or
  copy's median length, and the stream's busy time per call.

Run one process per sample: the state that decides fast or slow is the
process's (RESULTS.md, session 18), so compare processes, not rounds.

  python benchmarks/host_profile.py --cases=llama3-8b/M4096:4096x14336x4096 \\
      --schedules=default --calls=200 --out_dir=/tmp/r --tag=p1
"""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
common.define_flags(default_peers="")
FLAGS.set_default("schedules", ["default"])
_CALLS = flags.DEFINE_integer("calls", 200, "Back-to-back calls per trace.",
                              lower_bound=1)
_TOP = flags.DEFINE_integer("top", 14, "Events kept per thread or stream, by"
                            " time per call.")

# Python's dispatch of one call: one per call on the calling thread.
_DISPATCH = "PjitFunction("


def _programs(case: common.Case, mesh):
  in_specs, out_spec = common.rs_specs()
  progs = [("xla", common.jit_shard_map(common.xla_rs, mesh, in_specs,
                                        out_spec)),
           ("trivial", common.trivial_program(mesh, in_specs))]
  progs += [(label, common.jit_shard_map(common.ficco_rs(label), mesh,
                                         in_specs, out_spec, check_vma=False))
            for label in FLAGS.schedules]
  args = (common.random_array(mesh, (case.m, case.k), in_specs[0], 1),
          common.random_array(mesh, (case.k, case.n), in_specs[1], 2))
  return progs, args


def _trace(fn, args, calls: int):
  """ProfileData of `calls` back-to-back calls (after 20 untimed ones)."""
  import jax
  for _ in range(20):
    out = fn(*args)
  jax.block_until_ready(out)
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0  # Its hooks would dominate a 0.2 ms call.
  opts.host_tracer_level = 2
  d = tempfile.mkdtemp(prefix="ficco_prof_")
  try:
    with jax.profiler.trace(d, profiler_options=opts):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    pb = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if len(pb) != 1:
      # One process, one host: one file. More would mean a trace this
      # report cannot attribute.
      raise RuntimeError(f"expected one .xplane.pb under {d}, found {pb}")
    return jax.profiler.ProfileData.from_file(pb[0])
  finally:
    shutil.rmtree(d, ignore_errors=True)


def _event_table(events, calls: int, top: int) -> list[dict]:
  """Per event name: count per call, median and total µs per call; an
  event nested in an earlier one of the same name counts once (jax nests
  a dispatch's event in another of its name)."""
  by = collections.defaultdict(list)
  open_until: dict[str, float] = {}
  for e in sorted(events, key=lambda e: e.start_ns):
    if e.start_ns < open_until.get(e.name, float("-inf")):
      continue
    open_until[e.name] = e.end_ns
    by[e.name].append(e.duration_ns / 1e3)
  rows = [dict(name=n[:120], per_call=len(d) / calls,
               median_us=statistics.median(d), us_per_call=sum(d) / calls)
          for n, d in by.items()]
  rows.sort(key=lambda r: -r["us_per_call"])
  return rows[:top]


def _outermost_starts(events) -> list[float]:
  """Starts of the events not nested in an earlier one (jax nests a
  dispatch's event in another of the same name)."""
  starts, end = [], float("-inf")
  for e in sorted(events, key=lambda e: e.start_ns):
    if e.start_ns >= end:
      starts.append(e.start_ns)
      end = e.end_ns
  return starts


def _summarize(pd, calls: int, top: int) -> dict:
  """Host period, per-thread and per-stream event tables of one trace."""
  res = {"threads": [], "streams": []}
  for plane in pd.planes:
    if plane.name == "/host:CPU":
      for line in plane.lines:
        events = list(line.events)
        starts = _outermost_starts(
            e for e in events if e.name.startswith(_DISPATCH))
        entry = {"thread": line.name, "events": _event_table(events, calls,
                                                             top)}
        if len(starts) > 2:
          gaps = [(b - a) / 1e3 for a, b in zip(starts, starts[1:])]
          entry["dispatch_period_us"] = statistics.median(gaps)
          # The calling thread: the one with the most dispatches.
          if len(starts) > res.get("_dispatches", 0):
            res["_dispatches"] = len(starts)
            res["host_period_us"] = entry["dispatch_period_us"]
        if entry["events"]:
          res["threads"].append(entry)
    elif plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        events = list(line.events)
        if not events:
          continue
        span = (max(e.end_ns for e in events) - min(e.start_ns for e in events))
        busy = sum(e.duration_ns for e in events)
        res["streams"].append({
            "plane": plane.name, "stream": line.name,
            "busy_us_per_call": busy / 1e3 / calls,
            "span_us_per_call": span / 1e3 / calls,
            "events": _event_table(events, calls, top)})
  res.pop("_dispatches", None)
  return res


def _case(case: common.Case, w: int) -> dict:
  import jax
  mesh = common.mesh_of(w)
  progs, args = _programs(case, mesh)
  rec = {"name": case.name, "W": w, "M": case.m, "K": case.k, "N": case.n,
         "default_schedule": common.resolve_default(
             "matmul_reduce_scatter", x_shape=(case.m, case.k // w),
             w_shape=(case.k // w, case.n), axis_size=w),
         "programs": []}
  tk = dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)
  timed = []
  with timing.interleaved(True):
    for label, fn in progs:
      jax.block_until_ready(fn(*args))
      m = timing.time_jax(fn, [args], **tk)
      m["label"] = label
      timed.append(m)
  for (label, fn), m in zip(progs, timed):
    p = {"label": label, "median_ms": m.get("median_ms"),
         "rounds_ms": m.get("rounds_ms"), "error": m.get("error")}
    try:
      p.update(_summarize(_trace(fn, args, _CALLS.value), _CALLS.value,
                          _TOP.value))
    except Exception as e:  # pylint: disable=broad-except
      p["trace_error"] = common.short_error(e)
    rec["programs"].append(p)
  return rec


def _events(events, name_chars=None) -> list[str]:
  """A thread's or stream's events as a markdown table, then a blank line."""
  return (["| event | per call | median µs | µs per call |", "|---|---|---|---|"]
          + [f"| {e['name'][:name_chars]} | {e['per_call']:.2f} |"
             f" {e['median_us']:.1f} | {e['us_per_call']:.1f} |"
             for e in events] + [""])


def _markdown(data: dict) -> str:
  meta = data["meta"]
  lines = ["# Host profile: matmul_reduce_scatter per call, bf16", "",
           f"{meta['device_count']} x {meta['device_kind']}, jax {meta['jax']},"
           f" {meta['date']}", f"`{meta['command']}`", "",
           "Per call: median of interleaved rounds, untraced. Traced: the"
           " host period (Python's dispatch to dispatch) and each thread's"
           " or GPU stream's events, µs per call.", ""]
  for rec in data["cases"]:
    lines += [f"## {rec['name']} ({rec['M']}x{rec['K']}x{rec['N']}),"
              f" default = {rec['default_schedule']}", ""]
    for p in rec["programs"]:
      period = p.get("host_period_us")
      lines += [f"### {p['label']}: {p['median_ms']} ms per call untraced;"
                f" traced host period {period and round(period, 1)} µs", ""]
      if p.get("trace_error"):
        lines += [f"trace failed: {p['trace_error'][:300]}", ""]
        continue
      for t in p["threads"]:
        lines += [f"thread `{t['thread']}`", ""] + _events(t["events"])
      for s in p["streams"]:
        lines += [f"{s['plane']} stream `{s['stream']}`: busy"
                  f" {s['busy_us_per_call']:.1f} µs per call over a span of"
                  f" {s['span_us_per_call']:.1f}", ""]
        # Kernel names carry their template arguments: cut them short.
        lines += _events(s["events"], name_chars=80)
  return "\n".join(lines)


def main(argv):
  del argv
  common.configure_timing()
  cases = common.required_cases()
  data = {"meta": common.env_info("rs"), "cases": []}
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  path = os.path.join(FLAGS.out_dir, f"host_profile_{FLAGS.tag or 'run'}")
  for case in cases:
    for w in (int(a) for a in FLAGS.axis_sizes):
      data["cases"].append(_case(case, w))
      with open(path + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
      with open(path + ".md", "w") as f:
        f.write(_markdown(data) + "\n")
  print(_markdown(data), flush=True)


if __name__ == "__main__":
  app.run(main)
