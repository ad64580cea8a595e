"""Reads a JAX profiler trace (perfetto JSON) and says where device time went.

``jax.profiler.start_trace(dir, create_perfetto_trace=True)`` writes
``perfetto_trace.json.gz``: one process per GPU with one thread per CUDA
stream (kernels and copies, from CUPTI), and one for the host threads. Only
the standard library is needed, so a trace can be read on any machine:

* per GPU: the traced window, and per stream its busy time, event count and
  heaviest event names (copy-engine transfers show up as Memcpy events on
  ficco's side streams);
* the compute stream's idle gaps (the stream with the most kernel time),
  grouped by the event before and after each gap, which is where a step
  waits on a collective, a copy, or the host; for each, what most likely
  ended it: an event on another stream that finished just before the next
  kernel started (`WAKE_US`), or nothing on that GPU (the host, or a
  peer GPU's flag);
* how much of the copies ran while the compute stream was busy (overlap);
* the collectives' kernels (NCCL): how long they ran on the compute stream
  itself (exposed: nothing else runs on that stream meanwhile) and off it,
  and how much of the latter ran while the compute stream was busy; with
  the idle gaps this bounds what hiding the communication can still gain;
* one call's timeline on the first GPU;
* the busiest host threads' self time per event name.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import os


def load(trace_dir: str) -> list[dict]:
  """Events of the newest perfetto trace under ``trace_dir``."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto*.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(paths[-1]) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _names(events):
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    elif e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
  return procs, threads


def _union(intervals):
  total, end = 0.0, -1e30
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def _is_copy(name: str) -> bool:
  n = name.lower()
  return "memcpy" in n or "memset" in n


def _is_collective(name: str) -> bool:
  return "nccl" in name.lower()


def _short(name: str, n: int = 48) -> str:
  return name if len(name) <= n else name[: n - 3] + "..."


# A compute-stream gap that ends within this of another stream's event
# ending most likely waited for it (a stream wait on its event, or a flag
# it wrote): the next kernel starts a few microseconds after the
# dependency resolves.
WAKE_US = 15.0


def _gap_cause(ends, others, start: float, end: float, stream_name) -> str:
  """How a compute-stream gap from ``start`` to ``end`` (us) likely ended:
  the event on another stream of this GPU that finished last in the gap,
  if it finished within `WAKE_US` of the gap's end; else nothing on this
  GPU did: the next kernel came late from the host (its launch, or a
  host-side wait before it), or waited for a flag another GPU wrote.
  ``others``: (end, event, stream) sorted by end; ``ends`` their ends."""
  # Up to 1 us past the gap's end: trace timestamps of two streams are not
  # exact to the microsecond.
  i = bisect.bisect_right(ends, end + 1.0) - 1
  if i >= 0 and others[i][0] > start and end - others[i][0] <= WAKE_US:
    _, e, tid = others[i]
    return f"after {_short(e['name'], 28)} on {str(stream_name(tid))[-22:]}"
  return ("with nothing else on this GPU ending just before (the host, or a"
          " peer's flag)")


def summarize(events: list[dict], *, calls: int = 1, gap_us: float = 3.0,
              timeline_events: int = 50, host_events: int = 14,
              host_timeline: bool = False,
              stats: list[dict] | None = None) -> str:
  """A text report (see the module docstring).

  With ``host_timeline``, it ends with the last call's host timeline:
  every XLA execute thread's events of at least 1 us, nested, in us from
  that call's dispatch, which shows where one thread waits for another.
  With ``stats``, one dict per GPU is appended to it, in ms per call:
  ``window``, ``compute_busy``, ``exposed`` (collectives on the compute
  stream), ``collectives_off``, ``copies_off`` and ``idle`` (the compute
  stream's gaps).
  """
  procs, threads = _names(events)
  gpus = sorted((pid for pid, n in procs.items() if "GPU" in n),
                key=lambda p: procs[p])
  lines = []
  by_pid = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("dur") is not None:
      by_pid[e["pid"]].append(e)
  for gi, pid in enumerate(gpus):
    evs = by_pid[pid]
    if not evs:
      continue
    t0 = min(e["ts"] for e in evs)
    t1 = max(e["ts"] + e["dur"] for e in evs)
    streams = collections.defaultdict(list)
    for e in evs:
      streams[e.get("tid")].append(e)
    # The compute stream: the most kernel time, collectives not counted
    # (XLA may run NCCL on a stream of its own).
    kernel_busy = {
        tid: sum(e["dur"] for e in es if not _is_copy(e["name"])
                 and not _is_collective(e["name"]))
        for tid, es in streams.items()}
    compute = max(kernel_busy, key=kernel_busy.get)
    comp = sorted(streams[compute], key=lambda e: e["ts"])
    comp_iv = [(e["ts"], e["ts"] + e["dur"]) for e in comp]
    lines.append(f"## {procs[pid]}: window {(t1 - t0) / 1e3:.3f} ms,"
                 f" {(t1 - t0) / 1e3 / calls:.3f} ms per call ({calls} calls)")
    for tid, es in sorted(streams.items(), key=lambda kv: -sum(
        e["dur"] for e in kv[1])):
      busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in es])
      per = collections.Counter()
      for e in es:
        per[_short(e["name"], 40)] += e["dur"]
      top = ", ".join(f"{n} {d / 1e3 / calls:.3f}" for n, d in
                      per.most_common(3))
      tag = " (compute)" if tid == compute else ""
      lines.append(f"  stream {threads.get((pid, tid), tid)}{tag}:"
                   f" busy {busy / 1e3 / calls:.3f} ms/call,"
                   f" {len(es) / calls:.0f} events/call; top: {top}")
    # Copies overlapped with compute.
    copies = [(e["ts"], e["ts"] + e["dur"]) for tid, es in streams.items()
              for e in es if _is_copy(e["name"]) and tid != compute]
    if copies:
      copy_busy = _union(copies)
      both = _union(comp_iv) + copy_busy - _union(comp_iv + copies)
      lines.append(f"  copies off the compute stream: {copy_busy / 1e3 / calls:.3f}"
                   f" ms/call, {100 * both / max(copy_busy, 1e-9):.0f}% of it"
                   " while the compute stream was busy")
    on = [(e["ts"], e["ts"] + e["dur"]) for e in comp
          if _is_collective(e["name"])]
    off = [(e["ts"], e["ts"] + e["dur"]) for tid, es in streams.items()
           for e in es if _is_collective(e["name"]) and tid != compute]
    if on or off:
      work = [iv for e, iv in zip(comp, comp_iv)
              if not _is_collective(e["name"])]
      hidden = _union(work) + _union(off) - _union(work + off)
      lines.append(f"  collectives on the compute stream (exposed):"
                   f" {_union(on) / 1e3 / calls:.3f} ms/call; off it:"
                   f" {_union(off) / 1e3 / calls:.3f} ms/call,"
                   f" {100 * hidden / max(_union(off), 1e-9):.0f}% of it"
                   " while the compute stream ran other work")
    gaps = collections.Counter()
    gap_n = collections.Counter()
    causes = collections.defaultdict(collections.Counter)
    others = sorted(((e["ts"] + e["dur"], e, tid) for tid, es in
                     streams.items() if tid != compute for e in es),
                    key=lambda x: x[0])
    ends = [o[0] for o in others]
    total_gap = 0.0
    for a, b in zip(comp, comp[1:]):
      g = b["ts"] - (a["ts"] + a["dur"])
      if g > gap_us:
        key = f"{_short(a['name'], 36)} -> {_short(b['name'], 36)}"
        gaps[key] += g
        gap_n[key] += 1
        total_gap += g
        causes[key][_gap_cause(ends, others, a["ts"] + a["dur"], b["ts"],
                               lambda t: threads.get((pid, t), t))] += 1
    lines.append(f"  compute stream idle (gaps > {gap_us:g} us):"
                 f" {total_gap / 1e3 / calls:.3f} ms/call")
    if stats is not None:
      ms = lambda us: us / 1e3 / calls  # noqa: E731
      stats.append({
          "gpu": procs[pid], "window": ms(t1 - t0),
          "compute_busy": ms(_union(comp_iv)), "exposed": ms(_union(on)),
          "collectives_off": ms(_union(off)),
          "copies_off": ms(_union(copies)),
          "idle": ms(total_gap)})
    for key, g in gaps.most_common(8):
      lines.append(f"    {g / 1e3 / calls:.3f} ms/call in {gap_n[key] / calls:.1f}"
                   f" gaps/call: {key}")
      lines.append("      ends " + "; ".join(
          f"{c} ({n / calls:g}/call)" for c, n in causes[key].most_common(2)))
    if gi == 0 and timeline_events:
      start = t1 - (t1 - t0) / calls
      last = sorted((e for e in evs if e["ts"] + e["dur"] >= start),
                    key=lambda e: e["ts"])[:timeline_events]
      lines.append("  last call's timeline (us from its start; stream; dur):")
      for e in last:
        lines.append(f"    {e['ts'] - start:9.1f} {str(threads.get((pid, e.get('tid')), e.get('tid')))[-14:]:>14}"
                     f" {e['dur']:8.1f}  {_short(e['name'], 60)}")
  # Host threads: self time (an event's duration minus its children's) per
  # event name, so nested wrappers do not hide the work.
  host_self = collections.defaultdict(collections.Counter)
  host_count = collections.defaultdict(collections.Counter)
  for pid, n in procs.items():
    if "GPU" in n:
      continue
    # Nesting is per thread (tid); pool threads may share a name.
    per_thread = collections.defaultdict(list)
    for e in by_pid[pid]:
      per_thread[e.get("tid")].append(e)
    for tid, es in per_thread.items():
      tname = threads.get((pid, tid), str(tid))
      if list(threads.values()).count(tname) > 1:
        tname = f"{tname}#{tid}"
      es.sort(key=lambda e: (e["ts"], -e["dur"]))
      stack: list[list] = []  # [end, name, child time]
      def pop_until(ts):
        while stack and stack[-1][0] <= ts:
          end, name, child, dur = stack.pop()
          host_self[tname][name] += dur - child
      for e in es:
        pop_until(e["ts"])
        if stack:
          stack[-1][2] += e["dur"]
        name = _short(e["name"], 44)
        host_count[tname][name] += 1
        stack.append([e["ts"] + e["dur"], name, 0.0, e["dur"]])
      pop_until(float("inf"))
  busiest = sorted(host_self.items(), key=lambda kv: -sum(kv[1].values()))[:5]
  if busiest:
    lines.append("## host threads (busiest): self time per event name,"
                 " ms per call (events per call)")
    for name, c in busiest:
      top = ", ".join(
          f"{n} {d / 1e3 / calls:.3f} ({host_count[name][n] / calls:g})"
          for n, d in c.most_common(host_events))
      lines.append(f"  {name}: total {sum(c.values()) / 1e3 / calls:.3f}; {top}")
  if host_timeline:
    lines += _host_timeline(procs, threads, by_pid)
  return "\n".join(lines)


def _host_timeline(procs, threads, by_pid, depth: int = 7) -> list[str]:
  """The last call on the host: each execute thread's events, nested."""
  host = [e for pid, n in procs.items() if "GPU" not in n for e in by_pid[pid]]
  dispatch = [e for e in host if e["name"].startswith("PjitFunction")]
  if not dispatch:
    return ["## host timeline: no PjitFunction event"]
  t0 = max(e["ts"] for e in dispatch)
  lines = ["## last call's host timeline (us from its dispatch; dur;"
           " nested events indented)"]
  per_thread = collections.defaultdict(list)
  for e in host:
    if e["ts"] + e["dur"] >= t0 and e["dur"] >= 1.0:
      per_thread[(e["pid"], e.get("tid"))].append(e)
  for key, es in sorted(per_thread.items(), key=lambda kv: str(
      threads.get(kv[0], kv[0]))):
    lines.append(f"  thread {threads.get(key, key)}:")
    es.sort(key=lambda e: (e["ts"], -e["dur"]))
    ends: list[float] = []
    for e in es:
      while ends and ends[-1] <= e["ts"]:
        ends.pop()
      if len(ends) < depth:
        lines.append(f"    {e['ts'] - t0:8.1f} {e['dur']:7.1f} "
                     + "  " * len(ends) + _short(e["name"], 60))
      ends.append(e["ts"] + e["dur"])
  return lines
