"""Suite ``profile``: JAX profiler traces of chosen programs, summarized.

Each ``--specs`` item is ``op:MxKxN:label`` (global sizes as in the ops
suite; ``op`` is ``ag`` or ``rs``; ``label`` a schedule label, ``default``,
or ``xla`` for XLA's collective + dot). Per spec: compile, warm up, trace
``--calls`` back-to-back calls, and summarize the trace
(lib/trace_summary.py: streams, compute-stream gaps, copy overlap, one
call's timeline, host self time). Each summary goes to
``profile_<n>.txt``; ``profile.{json,md}`` collect them. Suite ``step``
traces training steps with the same code (``--profile_steps``).

With ``--processes=N`` the suite runs as N JAX processes (one per GPU
group, as the ``ops`` suite does): every process traces the same calls of
its own devices; process ``k`` writes ``profile_<n>_p<k>.txt`` and process
0 also the JSON and markdown, with every process's summary.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from absl import flags

from lib import cases as cases_lib
from lib import jax_util
from lib import meta as meta_lib
from lib import multiprocess
from lib import programs
from lib import report
from lib import results
from lib import schedules as schedules_lib
from lib import trace_summary

FLAGS = flags.FLAGS
flags.DEFINE_list("specs", [], "profile: op:MxKxN:label items, e.g."
                  " rs:4096x8192x8192:direct/c1/dma,rs:4096x8192x8192:xla.")
flags.DEFINE_integer("calls", 10, "profile: traced calls per spec.")
flags.DEFINE_bool("host_timeline", False, "profile: end each summary with"
                  " the last call's host timeline.")


def trace(step, state, calls: int, host_timeline: bool = False,
          timeline_events: int = 50, stats: list | None = None) -> str:
  """Traces ``calls`` calls ``state = step(i, state)``; returns the summary
  (with the first ``timeline_events`` events of the last call on the first
  GPU; per-GPU figures appended to ``stats``, `trace_summary.summarize`)."""
  import jax
  tmp = tempfile.mkdtemp(prefix="ficco_prof_")
  try:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    try:
      for i in range(calls):
        state = step(i, state)
      jax.block_until_ready(state)
    finally:
      # A failed call must not leave the profiler on for the next spec.
      jax.profiler.stop_trace()
    return trace_summary.summarize(trace_summary.load(tmp), calls=calls,
                                   host_timeline=host_timeline,
                                   timeline_events=timeline_events,
                                   stats=stats)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _program(spec: str, w: int):
  """(jitted fn, arg sets) of one spec on the first ``w`` devices."""
  key, shape, label = spec.split(":")
  op = programs.OPS[key]
  mesh = jax_util.mesh_of(w)
  case = cases_lib.parse(shape)
  if label == "xla":
    body = op.xla_body()
  else:
    [(_, sched)] = schedules_lib.parse([label])
    body = op.ficco_body(sched)
  return op.shard_mapped(mesh, body), op.inputs(mesh, case, 2)


def _gathered(text: str) -> list[str]:
  """Every process's ``text``, in process order (one process: ``[text]``)."""
  import jax
  if jax.process_count() == 1:
    return [text]
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  raw = np.frombuffer(text.encode(), np.uint8)
  size = multihost_utils.process_allgather(np.int32(raw.size)).max()
  padded = np.zeros(int(size), np.uint8)
  padded[:raw.size] = raw
  rows = multihost_utils.process_allgather(padded)
  return [bytes(r).rstrip(b"\0").decode() for r in np.asarray(rows)]


def run() -> int:
  if FLAGS.processes > 1 and not multiprocess.is_child():
    return multiprocess.relaunch(FLAGS.processes)
  import jax
  w = FLAGS.axis_size or jax.device_count()
  meta = meta_lib.collect("profile")
  directory = results.out_dir(meta["device_kind"], w, jax.process_count())
  data = {"meta": meta, "axis_size": w, "calls": FLAGS.calls,
          "processes": jax.process_count(), "profiles": []}
  rec = results.Recorder("profile", directory, data, markdown,
                         writer=multiprocess.is_writer(),
                         agree=multiprocess.agree)
  for i, spec in enumerate(FLAGS.specs):
    def one(spec=spec):
      fn, args = _program(spec, w)
      for k in range(5):  # Compile and warm up outside the trace.
        out = fn(*args[k % 2])
      jax.block_until_ready(out)
      return {"summary": trace(lambda k, _: fn(*args[k % 2]), None,
                               FLAGS.calls, FLAGS.host_timeline)}
    r = results.guarded(rec, f"profile {spec}", one)
    r["spec"] = spec
    text = r.get("summary") or f"FAILED {r.get('error')}"
    k = jax.process_index()
    r["file"] = f"profile_{i}.txt" if k == 0 else f"profile_{i}_p{k}.txt"
    results.write_text(os.path.join(directory, r["file"]),
                       f"# {spec} ({FLAGS.calls} calls)\n{text}\n")
    print(f"# {spec}\n{text}", flush=True)
    texts = _gathered(text)
    if len(texts) > 1:
      r["process_summaries"] = texts
    data["profiles"].append(r)
    rec.save()
  rec.finish()
  return 0


def markdown(data: dict) -> str:
  lines = [f"# Profiles, W={data['axis_size']}, {data['calls']} calls each",
           ""] + report.provenance(data["meta"])
  for p in data["profiles"]:
    texts = p.get("process_summaries") or [
        p.get("summary") or f"FAILED {p.get('error')}"]
    for k, text in enumerate(texts):
      name = p["file"] if k == 0 else p["file"].replace(".txt", f"_p{k}.txt")
      where = f", process {k}" if len(texts) > 1 else ""
      lines += ["", f"## `{p['spec']}` ({name}{where})", "", "```",
                text, "```"]
  return "\n".join(lines) + "\n"
