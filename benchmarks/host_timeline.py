"""Host timeline of a host-bound op, round by round: why some rounds run slow.

Host-bound reduce-scatters (llama3-8b M4096 on 4xH200) run in two modes, whole
rounds at a time: ~0.21 against ~0.26 ms per call (session 14). This times
XLA's program and ficco's, interleaved, for many rounds, and for every ficco
round records:

* the peer-copy handlers' host timeline (`library.trace_*`, xla_ffi/
  host_trace.h): per device, the intervals between consecutive events on
  XLA's thread (start enter/exit per call site, sync enter/issued/exit) and
  on the issuer thread (handoff, wait for the peers, issue), the per-call
  period, the skew of the devices' arrivals, and the CPUs each ran on;
* every thread's scheduler counters (``/proc/self/task/*/schedstat``: time
  on a CPU, time waiting for one; context switches from ``status``), by
  thread name.

The report splits ficco's rounds at the largest gap in their per-call times
and shows each metric's median in the fast and the slow group, so whatever
moves with the mode stands out.

  python benchmarks/host_timeline.py --m=4096 --k=14336 --n=4096 \\
      --schedules=default --rounds=30 --iters=80 --out=timeline.json
"""

from __future__ import annotations

import collections
import functools
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import host_floor  # noqa: E402  (its --m/--k/--n/--axis_size/--out flags)

FLAGS = flags.FLAGS
_OP = flags.DEFINE_enum("op", "rs", ["rs", "ag"], "The op to trace.")
_CAPACITY = flags.DEFINE_integer("trace_capacity", 200_000,
                                 "Trace events kept per round.")
_MARK = flags.DEFINE_bool("mark", True,
                          "Record Python's dispatch of every call too.")
_SETTLE = flags.DEFINE_integer("settle_calls", 20,
                               "Untimed calls before each timed block.")
_TAG = flags.DEFINE_string("variant", "", "A name for this run's variant"
                           " (environment), copied into the report.")
_GPU = flags.DEFINE_bool("gpu_stamps", False,
                         "Add GPU timestamps (CUDA; ~2 us of host time per"
                         " stamp, 11 per call and device on a direct"
                         " reduce-scatter).")

_XLA_POINTS = ("start_enter", "start_exit", "sync_enter", "sync_issued",
               "sync_exit")
_ISSUER_POINTS = ("issue_begin", "peers_arrived", "issue_end")


# ------------------------------------------------------------- thread stats


def _thread_deltas(before: dict, after: dict, calls: int) -> dict:
  """Per thread name (threads of one name summed): us per call on a CPU and
  waiting for one, context switches per call, and the CPUs they ended on."""
  groups: dict[str, dict] = {}
  for tid, a in after.items():
    b = before.get(tid)
    if b is None:
      continue
    name = a["name"]
    # One group per distinct name; numbered names keep their number.
    g = groups.setdefault(name, dict(threads=0, run_us=0.0, wait_us=0.0,
                                     vol=0.0, invol=0.0, cpus=[]))
    g["threads"] += 1
    g["run_us"] += (a["run_ns"] - b["run_ns"]) / 1e3 / calls
    g["wait_us"] += (a["wait_ns"] - b["wait_ns"]) / 1e3 / calls
    g["vol"] += (a["vol"] - b["vol"]) / calls
    g["invol"] += (a["invol"] - b["invol"]) / calls
    g["cpus"].append(a["cpu"])
  # Only threads that did something this round.
  return {k: v for k, v in groups.items() if v["run_us"] > 0.5}


def _cpu_topology() -> dict[int, str]:
  """CPU -> "package:core", so two threads on SMT siblings show."""
  out = {}
  root = "/sys/devices/system/cpu"
  for name in os.listdir(root):
    if not (name.startswith("cpu") and name[3:].isdigit()):
      continue
    try:
      with open(f"{root}/{name}/topology/physical_package_id") as f:
        pkg = f.read().strip()
      with open(f"{root}/{name}/topology/core_id") as f:
        core = f.read().strip()
    except OSError:
      continue
    out[int(name[3:])] = f"{pkg}:{core}"
  return out


# ----------------------------------------------------------------- analysis


def _median(xs):
  return statistics.median(xs) if xs else None


def analyze(events: list[dict], calls: int) -> dict:
  """Medians (us) of the timeline's intervals over devices and calls."""
  sites = sorted({e["tag"] for e in events if e["point"] == "start_enter"})
  if not sites:
    raise ValueError(
        f"no peer-copy start in the trace ({len(events)} events): the"
        " schedule does not use comm='dma' on this shape.")
  site_ix = {s: i for i, s in enumerate(sites)}

  def name(e):
    if e["point"].startswith("start") or e["point"] in _ISSUER_POINTS:
      return f"{e['point']}{site_ix.get(e['tag'], '?')}"
    return e["point"]

  by_dev = collections.defaultdict(list)
  for e in events:
    if e["device"] >= 0:
      by_dev[e["device"]].append(e)
  intervals = collections.defaultdict(list)
  issuer = collections.defaultdict(list)
  periods, handoffs, cpus_xla, cpus_iss = [], [], {}, {}
  migrations = {"xla": 0, "issuer": 0}
  arrivals = collections.defaultdict(dict)  # (site, k) -> device -> t
  for dev, evs in by_dev.items():
    evs.sort(key=lambda e: e["t_ns"])
    xla = [e for e in evs if e["point"] in _XLA_POINTS]
    iss = [e for e in evs if e["point"] in _ISSUER_POINTS]
    for a, b in zip(xla, xla[1:]):
      intervals[f"{name(a)}->{name(b)}"].append((b["t_ns"] - a["t_ns"]) / 1e3)
      migrations["xla"] += a["cpu"] != b["cpu"]
    for a, b in zip(iss, iss[1:]):
      if a["point"] != "issue_end":
        issuer[f"{name(a)}->{name(b)}"].append((b["t_ns"] - a["t_ns"]) / 1e3)
      migrations["issuer"] += a["cpu"] != b["cpu"]
    cpus_xla[dev] = sorted({e["cpu"] for e in xla})
    cpus_iss[dev] = sorted({e["cpu"] for e in iss})
    # The period: consecutive entries into the first site's start.
    first = [e["t_ns"] for e in xla
             if e["point"] == "start_enter" and e["tag"] == sites[0]]
    periods += [(b - a) / 1e3 for a, b in zip(first, first[1:])]
    # Handoff: a start's exit to its issuer's begin, k-th with k-th per site.
    for s in sites:
      exits = [e["t_ns"] for e in xla
               if e["point"] == "start_exit" and e["tag"] == s]
      begins = [e["t_ns"] for e in iss
                if e["point"] == "issue_begin" and e["tag"] == s]
      handoffs += [(b - a) / 1e3 for a, b in zip(exits, begins)]
      enters = [e["t_ns"] for e in xla
                if e["point"] == "start_enter" and e["tag"] == s]
      for k, t in enumerate(enters):
        arrivals[(s, k)][dev] = t
  skews = [(max(d.values()) - min(d.values())) / 1e3
           for d in arrivals.values() if len(d) == len(by_dev)]
  gpu = _analyze_gpu(by_dev, site_ix) if any(
      "gpu_ns" in e for e in events) else {}
  marks = sorted(e["t_ns"] for e in events if e["point"] == "mark")
  dispatch = [(b - a) / 1e3 for a, b in zip(marks, marks[1:])]
  return {
      "events": len(events),
      "calls": calls,
      "xla_thread_us": {k: _median(v) for k, v in sorted(intervals.items())},
      "issuer_us": {k: _median(v) for k, v in sorted(issuer.items())},
      "period_us": _median(periods),
      "period_p90_us": (sorted(periods)[int(0.9 * (len(periods) - 1))]
                        if periods else None),
      "handoff_us": _median(handoffs),
      "arrival_skew_us": _median(skews),
      "python_dispatch_us": _median(dispatch),
      "cpus_xla": cpus_xla,
      "cpus_issuer": cpus_iss,
      "migrations": migrations,
      "gpu": gpu,
  }


def _analyze_gpu(by_dev: dict, site_ix: dict) -> dict:
  """Medians (us) of the GPU stamps' intervals, and the GPU's lag.

  Compute-stream stamps (``gpu_start`` per site, ``gpu_sync_in``,
  ``gpu_sync_out``): the GPU time between consecutive ones (what ran in
  between, or the GPU idling until the host enqueued it). Lag: a stamp's
  GPU time minus its host time, less the smallest such difference of its
  device in the round: how far the GPU ran behind the host (0: the GPU
  waited for the host). Copies: duration, and begin relative to the
  receiver's own stamp of the same start (the wait for the source's data).
  """
  site_of = lambda e: str(site_ix.get(e["tag"], "?"))
  intervals = collections.defaultdict(list)
  lags, lags_end, copy_us = [], [], collections.defaultdict(list)
  copy_delay = collections.defaultdict(list)
  for evs in by_dev.values():
    # Host order; a gpu_start precedes its start_enter on XLA's thread.
    compute, issuer = [], []
    pending_site = []
    for e in evs:
      if e["point"] == "gpu_start":
        pending_site.append(e)
      elif e["point"] == "start_enter" and pending_site:
        pending_site.pop(0)["site"] = site_of(e)
    for e in evs:
      if e["point"] in ("gpu_start", "gpu_sync_in", "gpu_sync_out"):
        compute.append(e)
      elif e["point"] in ("issue_begin", "issue_end", "gpu_copy_begin",
                          "gpu_copy_end"):
        issuer.append(e)
    label = lambda e: (f"start{e.get('site', '?')}" if e["point"] ==
                       "gpu_start" else e["point"][4:])
    for a, b in zip(compute, compute[1:]):
      intervals[f"{label(a)}->{label(b)}"].append(
          (b["gpu_ns"] - a["gpu_ns"]) / 1e3)
    if compute:
      h0 = compute[0]["t_ns"]
      off = [e["gpu_ns"] - (e["t_ns"] - h0) for e in compute]
      low = min(off)
      lag = [(o - low) / 1e3 for o in off]
      lags += lag
      lags_end += lag[-max(1, len(lag) // 8):]
    # Copies: assign each to the site of the issue it happened in.
    site, begin = None, None
    own = collections.defaultdict(list)  # site -> gpu_start times, in order
    for e in compute:
      if e["point"] == "gpu_start":
        own[e.get("site", "?")].append(e["gpu_ns"])
    seen = collections.Counter()
    for e in issuer:
      if e["point"] == "issue_begin":
        site = site_of(e)
      elif e["point"] == "gpu_copy_begin":
        begin = e
      elif e["point"] == "gpu_copy_end" and begin is not None:
        copy_us[site].append((e["gpu_ns"] - begin["gpu_ns"]) / 1e3)
        k = seen[site]
        seen[site] += 1
        if k < len(own.get(site, [])):
          copy_delay[site].append((begin["gpu_ns"] - own[site][k]) / 1e3)
        begin = None
  return {
      "compute_us": {k: _median(v) for k, v in sorted(intervals.items())},
      "lag_us": _median(lags),
      "lag_end_us": _median(lags_end),
      "copy_us": {k: _median(v) for k, v in sorted(copy_us.items())},
      "copy_begin_after_own_start_us": {
          k: _median(v) for k, v in sorted(copy_delay.items())},
  }


def _split(rounds: list[dict]) -> tuple[list[dict], list[dict], float]:
  """Fast and slow rounds, cut at the largest gap in per-call time."""
  ts = sorted(r["ficco_ms"] for r in rounds)
  gaps = [(b - a, (a + b) / 2) for a, b in zip(ts, ts[1:])]
  cut = max(gaps)[1] if gaps else float("inf")
  return ([r for r in rounds if r["ficco_ms"] < cut],
          [r for r in rounds if r["ficco_ms"] >= cut], cut)


def _flat(r: dict) -> dict[str, float]:
  """A round's numeric metrics, one level deep, for the fast/slow table."""
  a = r["timeline"]
  out = {"ms per call": r["ficco_ms"], "XLA ms per call": r["xla_ms"],
         "trivial program ms per call": r["trivial_ms"],
         "period us": a["period_us"], "period p90 us": a["period_p90_us"],
         "handoff us": a["handoff_us"], "arrival skew us": a["arrival_skew_us"],
         "python dispatch us": a["python_dispatch_us"],
         "xla-thread migrations": a["migrations"]["xla"],
         "issuer migrations": a["migrations"]["issuer"]}
  for k, v in a["xla_thread_us"].items():
    out[f"xla: {k}"] = v
  for k, v in a["issuer_us"].items():
    out[f"issuer: {k}"] = v
  g = a.get("gpu") or {}
  if g:
    out["gpu lag us"] = g["lag_us"]
    out["gpu lag, last calls, us"] = g["lag_end_us"]
    for k, v in g["compute_us"].items():
      out[f"gpu: {k}"] = v
    for k, v in g["copy_us"].items():
      out[f"gpu copy {k} us"] = v
    for k, v in g["copy_begin_after_own_start_us"].items():
      out[f"gpu copy {k} begin after own start us"] = v
  for name, g in r["threads"].items():
    for field in ("run_us", "wait_us", "invol"):
      out[f"thread {name}: {field}"] = g[field]
  return {k: v for k, v in out.items() if v is not None}


def report(res: dict) -> str:
  rounds = res["rounds"]
  fast, slow, cut = _split(rounds)
  lines = [f"# Host timeline: {res['label']}, {res['shape']}",
           f"device: {res['device_kind']}, jax {res['jax']}, variant:"
           f" {res['variant'] or '(as shipped)'}", "",
           f"ficco rounds (ms per call, in run order): "
           + ", ".join(f"{r['ficco_ms']:.3f}" for r in rounds),
           f"XLA rounds: " + ", ".join(f"{r['xla_ms']:.3f}" for r in rounds),
           f"median ficco {_median([r['ficco_ms'] for r in rounds]):.3f},"
           f" XLA {_median([r['xla_ms'] for r in rounds]):.3f}, trivial"
           f" program (the host's speed)"
           f" {_median([r['trivial_ms'] for r in rounds]):.3f};"
           f" split at {cut:.3f}: {len(fast)} fast, {len(slow)} slow", ""]
  flat_f = [_flat(r) for r in fast]
  flat_s = [_flat(r) for r in slow]
  keys = []
  for f in flat_f + flat_s:
    keys += [k for k in f if k not in keys]
  lines += ["| metric (median over rounds) | fast | slow | slow - fast |",
            "|---|---|---|---|"]
  for k in keys:
    a = _median([f[k] for f in flat_f if k in f])
    b = _median([f[k] for f in flat_s if k in f])
    d = "" if a is None or b is None else f"{b - a:+.2f}"
    fa = "" if a is None else f"{a:.2f}"
    fb = "" if b is None else f"{b:.2f}"
    lines.append(f"| {k} | {fa} | {fb} | {d} |")
  lines += ["", "CPUs per round (XLA threads by device; issuers by device):"]
  for r in rounds:
    a = r["timeline"]
    lines.append(f"- {r['ficco_ms']:.3f} ms: xla {a['cpus_xla']}, issuers"
                 f" {a['cpus_issuer']}")
  return "\n".join(lines)


# --------------------------------------------------------------------- main


def main(argv):
  del argv
  import jax
  from ficco_jax._src.dma import library

  w = host_floor._W.value  # pylint: disable=protected-access
  mesh = common.mesh_of(w)
  body, op_fn, in_specs, out_spec, args = host_floor._case(  # pylint: disable=protected-access
      _OP.value, mesh, w)
  label = FLAGS.schedules[0]
  sched = None if label == "default" else common.schedule_from_label(label)
  xla = common.jit_shard_map(body, mesh, in_specs, out_spec)
  ficco = common.jit_shard_map(
      functools.partial(op_fn, axis_name="x", schedule=sched), mesh,
      in_specs, out_spec)
  # The host's own speed, for comparing machines.
  trivial = common.trivial_program(mesh, in_specs)
  ordinals = [d.local_hardware_id for d in mesh.devices.flat]
  for fn in (xla, ficco, trivial):
    for _ in range(max(3, FLAGS.warmup)):
      out = fn(*args)
    jax.block_until_ready(out)
  calls = FLAGS.iters
  gpu_stamps = max(1, _CAPACITY.value // 16)  # Per device.
  rounds = []

  def timed(fn, trace):
    for _ in range(_SETTLE.value):
      out = fn(*args)
    jax.block_until_ready(out)
    before = common.threads() if trace else None
    if trace:
      library.trace_enable(_CAPACITY.value)
      if _GPU.value:
        library.trace_gpu_enable(gpu_stamps)
    t0 = time.perf_counter()
    for i in range(calls):
      if trace and _MARK.value:
        library.trace_mark(-1, i)
      out = fn(*args)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) * 1e3 / calls
    if not trace:
      return ms, None
    library.trace_disable()
    after = common.threads()
    events, recorded = library.trace_read(_CAPACITY.value)
    if _GPU.value:
      gpu_ns = {o: library.trace_gpu_times(o, gpu_stamps)
                for o in ordinals}
      for e in events:
        if e["point"].startswith("gpu_") and e["tag"] < len(
            gpu_ns.get(e["device"], ())):
          e["gpu_ns"] = gpu_ns[e["device"]][e["tag"]]
    timeline = analyze(events, calls)
    timeline["dropped"] = recorded - len(events)
    return ms, (timeline, _thread_deltas(before, after, calls))

  for r in range(FLAGS.rounds):
    order = [0, 1, 2]
    random.Random(r).shuffle(order)
    got = {}
    for i in order:
      got[i] = timed((xla, ficco, trivial)[i], trace=i == 1)
    timeline, threads = got[1][1]
    rounds.append({"round": r, "xla_ms": got[0][0], "ficco_ms": got[1][0],
                   "trivial_ms": got[2][0], "timeline": timeline,
                   "threads": threads})
    us = lambda v: "-" if v is None else f"{v:.1f}"
    print(f"round {r}: ficco {got[1][0]:.3f} ms, XLA {got[0][0]:.3f} ms,"
          f" period {us(timeline['period_us'])} us, skew"
          f" {us(timeline['arrival_skew_us'])} us", flush=True)
  res = {"env": common.env_info("host_timeline"), "label": label,
         "variant": _TAG.value,
         "env_vars": {k: v for k, v in os.environ.items()
                      if k.startswith(("FICCO_", "XLA_", "CUDA_"))},
         "op": _OP.value,
         "shape": [host_floor._M.value, host_floor._K.value,  # pylint: disable=protected-access
                   host_floor._N.value],  # pylint: disable=protected-access
         "axis_size": w, "device_ordinals": ordinals,
         "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
         "cpu_topology": _cpu_topology(), "nproc": os.cpu_count(),
         "affinity": sorted(os.sched_getaffinity(0)),
         "calls_per_round": calls, "rounds": rounds}
  md = report(res)
  print(md)
  out = host_floor._OUT.value  # pylint: disable=protected-access
  with open(out, "w") as f:
    json.dump(res, f, indent=1, default=str)
  with open(os.path.splitext(out)[0] + ".md", "w") as f:
    f.write(md + "\n")


if __name__ == "__main__":
  app.run(main)
