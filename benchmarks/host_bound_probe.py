"""The host-bound reduce-scatter: per-call time by transport and granularity,
and the same op inside one program.

On 4xH200, llama3-8b M4096's reduce-scatter needs ~0.2 ms of GPU work but
read 0.21 to 0.35 ms per call from machine to machine (RESULTS.md, sessions
15 and 17): per-call dispatch and ficco's host work bound it. This times,
interleaved (timing.interleaved), per shape:

* ``xla``: psum_scatter(h @ w) in shard_map; ``trivial``: ``h * 2``, the
  dispatch floor of a 4-device program;
* ficco with each ``--schedules`` label; a ``#push`` suffix lowers a
  flagged schedule over the push protocol (``FICCO_FLAGGED_TRANSPORT=push``:
  pieces pushed into the owners' windows; the default since session 22), a
  ``#rendezvous`` suffix over the rendezvous transport
  (``FICCO_FLAGGED_TRANSPORT=rendezvous``: a host rendezvous and pulls per
  call), a ``#window`` suffix the other granularities over the window
  transport (``FICCO_DMA_TRANSPORT=window``: flags in mapped windows and no
  per-call rendezvous of the devices' threads; xla_ffi/WINDOWS.md); without
  a suffix, the library's defaults;
* ``chainN``: ``--chain`` ops in one jitted program, each op's input made
  from the previous op's output (`_chained`), for XLA and each
  ``--chain_schedules`` label: the per-op time once Python's per-call
  dispatch is spread over N ops, as inside a model's step.

Every output is checked against XLA's (relative error; a chain against
XLA's chain). The run's host
steal time (``/proc/stat``) is recorded, as a sign of a contended host.

  python benchmarks/host_bound_probe.py --cases=4096x14336x4096 \\
      --schedules=default,direct/c1/dma/pallas,direct/c1/dma/pallas#window \\
      --chain=8 --chain_schedules=default --out_dir=/tmp/r --tag=probe
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import common  # noqa: E402
import timing  # noqa: E402

FLAGS = flags.FLAGS
common.define_flags(default_peers="")
# Labels only here (common's presets such as "quick" are not expanded).
FLAGS.set_default("schedules", ["default"])
_CHAIN = flags.DEFINE_integer("chain", 8, "Ops per program in the chained"
                              " variants; 0: none.")
_CHAIN_SCHEDULES = flags.DEFINE_list(
    "chain_schedules", ["default"], "ficco labels also timed chained.")
_PIN = flags.DEFINE_list(
    "pin", [],
    "Before timing, pin these groups of threads, each thread to its own CPU"
    " at fixed places (the first NUMA node, one CPU per core): main (Python's"
    " main thread, CPU #0), xla (the 4 busiest XLA execute threads, #1-4),"
    " issuers (ficco's, #5-8), cuda (CUDA's event handlers, #9-12), pool (the"
    " other XLA execute threads, after); 'cores' = all five. Empty: leave"
    " them to the scheduler. A diagnosis of the host, not a library"
    " feature.")
_AUTOTUNE = flags.DEFINE_bool(
    "autotune", False, "Also run ficco_jax.autotune (default candidates,"
    " store=False) on the first case, after the timings.")
_AUTOTUNE_ROUNDS = flags.DEFINE_integer("autotune_rounds", 7,
                                        "autotune's rounds.")
_AUTOTUNE_ITERS = flags.DEFINE_integer("autotune_iters", 20,
                                       "autotune's calls per round.")


def _steal_ticks() -> int | None:
  """The host's steal time so far (USER_HZ ticks), or None off Linux."""
  try:
    with open("/proc/stat") as f:
      fields = f.readline().split()
    return int(fields[8])  # cpu user nice system idle iowait irq softirq steal
  except (OSError, IndexError, ValueError):
    return None


def _cpu_list(text: str) -> list[int]:
  """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
  out = []
  for part in text.strip().split(","):
    if part:
      lo, _, hi = part.partition("-")
      out.extend(range(int(lo), int(hi or lo) + 1))
  return out


def _one_cpu_per_core() -> list[int]:
  """The first NUMA node's CPUs, one per physical core (the lowest of each
  core's SMT siblings), in order."""
  base = "/sys/devices/system"
  try:
    with open(f"{base}/node/node0/cpulist") as f:
      cpus = _cpu_list(f.read())
  except OSError:
    cpus = sorted(os.sched_getaffinity(0))
  out = []
  for cpu in cpus:
    try:
      with open(f"{base}/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
        if _cpu_list(f.read())[0] != cpu:
          continue
    except OSError:
      pass
    out.append(cpu)
  return out


_PIN_GROUPS = ("main", "xla", "issuers", "cuda", "pool")


def _pin_busy_threads(groups) -> dict[str, int | str]:
  """Pins the threads of ``groups`` (see --pin) one per CPU at fixed places,
  so a group lands on the same CPUs whichever others are pinned; returns
  {name/tid: cpu}."""
  found = sorted(((t["run_ns"], tid, t["name"])
                  for tid, t in common.threads().items()),
                 reverse=True)  # The busiest first.
  xla = [(t, n) for _, t, n in found if "xla_execute" in n]
  by_group = {
      "main": [(os.getpid(), "main")],
      "xla": xla[:4],
      "issuers": [(t, n) for _, t, n in found if "ficco-issue" in n][:4],
      "cuda": [(t, n) for _, t, n in found if "EvtHandlr" in n][:4],
      "pool": xla[4:],
  }
  cpus = _one_cpu_per_core()
  placed, slot = {}, 0
  for group in _PIN_GROUPS:
    members = by_group[group]
    width = len(members) if group == "pool" else (1 if group == "main" else 4)
    for (tid, name), cpu in zip(members, cpus[slot:slot + width]):
      if group not in groups:
        continue
      try:
        os.sched_setaffinity(tid, {cpu})
        placed[f"{name}/{tid}"] = cpu
      except OSError as e:
        placed[f"{name}/{tid}"] = f"failed: {e}"
    slot += width
  return placed


# A label's "#suffix": the environment its program is lowered under.
_SUFFIX_ENV = {
    "window": ("FICCO_DMA_TRANSPORT", "window"),
    "push": ("FICCO_FLAGGED_TRANSPORT", "push"),
    "rendezvous": ("FICCO_FLAGGED_TRANSPORT", "rendezvous"),
}


def _with_transport(fn, suffix: str | None):
  """``fn`` whose first call (the one that lowers) runs under the variable
  of ``suffix`` (`_SUFFIX_ENV`); later calls hit jit's cache (every call
  here passes arrays of the first call's shapes and shardings, so nothing
  retraces without the variable)."""
  if not suffix:
    return fn
  if suffix not in _SUFFIX_ENV:
    raise ValueError(f"Label suffix #{suffix} must be one of"
                     f" {sorted(_SUFFIX_ENV)}.")
  var, value = _SUFFIX_ENV[suffix]
  compiled = []

  def call(*args):
    if compiled:
      return fn(*args)
    old = os.environ.get(var)
    os.environ[var] = value
    try:
      out = fn(*args)
    finally:
      if old is None:
        del os.environ[var]
      else:
        os.environ[var] = old
    compiled.append(True)
    return out
  return call


def _chained(op, n: int):
  """``n`` ops in sequence, each input made from the previous op's output.

  One element of the next op's ``h`` is set from the previous op's result
  (an in-place update after one copy of the local ``h`` per program, 17-29
  MB on issue 6's shapes, ~1 us per op in XLA's and ficco's chains alike;
  on CPU the compiled chain of 8 holds 8 dots and 8 reduce-scatters), so
  XLA can neither merge the
  ops nor reorder them. An optimization barrier alone was not enough: XLA
  merged its own program's 8 identical dots into one (call A of session 18
  read 0.035 ms per op).
  """
  def body(a, b):
    out = op(a, b)
    for _ in range(n - 1):
      a = a.at[0, 0].set(out[0, 0].astype(a.dtype))
      out = op(a, b)
    return out
  return body


def _case(case: common.Case, w: int) -> dict:
  import jax

  mesh = common.mesh_of(w)
  in_specs, out_spec = common.rs_specs()
  args = [(common.random_array(mesh, (case.m, case.k), in_specs[0], 2 * i + 1),
           common.random_array(mesh, (case.k, case.n), in_specs[1], 2 * i + 2))
          for i in range(max(1, FLAGS.input_sets))]
  xla_op = common.xla_rs
  entries = [("xla", common.jit_shard_map(xla_op, mesh, in_specs, out_spec)),
             ("trivial", common.trivial_program(mesh, in_specs))]

  def ficco_op(label):
    return common.ficco_rs(label.partition("#")[0])

  for label in FLAGS.schedules:
    fn = common.jit_shard_map(ficco_op(label), mesh, in_specs, out_spec,
                              check_vma=False)
    entries.append((label, _with_transport(fn, label.partition("#")[2])))
  n = _CHAIN.value
  if n > 0:
    entries.append((f"chain{n} xla", common.jit_shard_map(
        _chained(xla_op, n), mesh, in_specs, out_spec)))
    for label in _CHAIN_SCHEDULES.value:
      fn = common.jit_shard_map(_chained(ficco_op(label), n), mesh, in_specs,
                                out_spec, check_vma=False)
      entries.append((f"chain{n} {label}",
                      _with_transport(fn, label.partition("#")[2])))

  rec = {"name": case.name, "W": w, "M": case.m, "K": case.k, "N": case.n,
         "default_schedule": common.resolve_default(
             "matmul_reduce_scatter", x_shape=(case.m, case.k // w),
             w_shape=(case.k // w, case.n), axis_size=w),
         "methods": []}
  refs = {}  # XLA's output, per call (False) and chained (True).
  tk = dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)
  with timing.interleaved(True):
    for label, fn in entries:
      try:
        out = jax.block_until_ready(fn(*args[0]))
        err = None
        chain = label.startswith("chain")
        if label in ("xla", f"chain{n} xla"):
          refs[chain] = out
        elif label != "trivial" and refs.get(chain) is not None:
          err = common.rel_err(out, refs[chain])
        del out
        # Kept, not copied: interleaved timing fills this dict on exit.
        m = timing.time_jax(fn, args, **tk)
        if err is not None:
          m["rel_err_vs_xla"] = err
          # bf16 outputs: --tol, as the other benches (a wrong op still
          # gets timed, and the tables say so).
          m["wrong"] = not err <= FLAGS.tol
      except Exception as e:  # pylint: disable=broad-except
        m = {"error": common.short_error(e)}
      m["label"] = label
      rec["methods"].append(m)
    groups = set(_PIN_GROUPS) if "cores" in _PIN.value else set(_PIN.value)
    if groups - set(_PIN_GROUPS):
      raise app.UsageError(f"--pin={_PIN.value}: groups are {_PIN_GROUPS}"
                           " or 'cores'.")
    if groups:
      # Every thread exists now (each program ran); timing starts on exit.
      rec["pinned"] = _pin_busy_threads(groups)
  for m in rec["methods"]:
    if m["label"].startswith("chain") and "median_ms" in m and n:
      m["per_op_ms"] = m["median_ms"] / n
  return rec


def _autotune(case: common.Case, w: int) -> dict:
  """ficco_jax.autotune on ``case`` with its default candidates."""
  import time
  from jax.sharding import PartitionSpec as P
  import ficco_jax

  mesh = common.mesh_of(w)
  h = common.random_array(mesh, (case.m, case.k), P(None, "x"), 1)
  wt = common.random_array(mesh, (case.k, case.n), P("x", None), 2)
  t0 = time.perf_counter()
  res = ficco_jax.autotune("matmul_reduce_scatter", h, wt, mesh=mesh,
                           axis_name="x", store=False,
                           rounds=_AUTOTUNE_ROUNDS.value,
                           iters=_AUTOTUNE_ITERS.value)
  return {"name": case.name, "W": w, "best": res.best.short(),
          "timings_ms": list(res.timings_ms), "errors": list(res.errors),
          "wall_s": time.perf_counter() - t0}


def _markdown(data: dict) -> str:
  meta = data["meta"]
  lines = ["# Host-bound probe: matmul_reduce_scatter, bf16",
           "",
           f"{meta['device_count']} x {meta['device_kind']}, jax {meta['jax']},"
           f" {meta['date']}",
           f"`{meta['command']}`",
           "",
           f"Host steal over the run: {data.get('steal_s')} s"
           f" ({data.get('steal_note')}).",
           "",
           "Per call: median over interleaved rounds (min); chained programs"
           " also per op. Speedup over XLA's per-call program, or for chains"
           " over XLA's chain.",
           ""]
  for rec in data["cases"]:
    lines += [f"## {rec['name']} ({rec['M']}x{rec['K']}x{rec['N']}), default"
              f" = {rec['default_schedule']}", ""]
    if rec.get("pinned"):
      lines += ["Pinned before timing: " + ", ".join(
          f"{k} -> {v}" for k, v in rec["pinned"].items()), ""]
    lines += ["| program | ms per call (min) | per op | vs XLA | rel err vs XLA"
              " | rounds |", "|---|---|---|---|---|---|"]
    base = {m["label"]: m.get("median_ms") for m in rec["methods"]}
    for m in rec["methods"]:
      if "error" in m:
        lines.append(f"| {m['label']} | error: {m['error'][:200]} | | | | |")
        continue
      ref = base.get(
          f"chain{_CHAIN.value} xla" if m["label"].startswith("chain")
          else "xla")
      ratio = (f"{ref / m['median_ms']:.3f}x" if ref and m.get("median_ms")
               else "")
      rounds = ", ".join(f"{t:.3f}" for t in m.get("rounds_ms", []))
      per_op = f"{m['per_op_ms']:.3f}" if "per_op_ms" in m else ""
      err = (f"{m['rel_err_vs_xla']:.4f}" if "rel_err_vs_xla" in m else "")
      if m.get("wrong"):
        err += " WRONG"
      lines.append(f"| {m['label']} | {m['median_ms']:.3f}"
                   f" ({m['min_ms']:.3f}) | {per_op} | {ratio} | {err} |"
                   f" {rounds} |")
    lines.append("")
  at = data.get("autotune")
  if at:
    lines += [f"## autotune, {at.get('name')} (default candidates,"
              f" interleaved rounds)", ""]
    if "error" in at:
      lines.append(f"error: {at['error']}")
    else:
      xla = next((m.get("median_ms") for m in data["cases"][0]["methods"]
                  if m["label"] == "xla"), None)
      lines += [f"best: `{at['best']}`; {len(at['timings_ms'])} candidates"
                f" timed in {at['wall_s']:.0f} s; {len(at['errors'])} failed.",
                "", "| schedule | ms per call | vs the probe's XLA |",
                "|---|---|---|"]
      for label, t in at["timings_ms"]:
        lines.append(f"| {label} | {t:.3f} |"
                     f" {f'{xla / t:.3f}x' if xla else ''} |")
      for label, err in at["errors"]:
        lines.append(f"| {label} | failed: {err[:200]} | |")
    lines.append("")
  return "\n".join(lines)


def main(argv):
  del argv
  common.configure_timing()
  cases = common.required_cases()
  data = {"meta": common.env_info("rs"), "cases": []}
  steal0 = _steal_ticks()
  hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  path = os.path.join(FLAGS.out_dir, f"host_bound_{FLAGS.tag or 'probe'}")

  def save():
    # After every case: a run cut short by its time limit keeps its cases.
    steal1 = _steal_ticks()
    if steal0 is not None and steal1 is not None:
      data["steal_s"] = (steal1 - steal0) / hz
      data["steal_note"] = "all CPUs, summed; /proc/stat"
    else:
      data["steal_s"], data["steal_note"] = None, "not readable"
    with open(path + ".json", "w") as f:
      json.dump(data, f, indent=1, default=str)
    md = _markdown(data)
    with open(path + ".md", "w") as f:
      f.write(md + "\n")
    return md

  for case in cases:
    for w in (int(a) for a in FLAGS.axis_sizes):
      data["cases"].append(_case(case, w))
      print(json.dumps(data["cases"][-1], default=str)[:2000], flush=True)
      save()
  if _AUTOTUNE.value:
    try:
      data["autotune"] = _autotune(cases[0], int(FLAGS.axis_sizes[0]))
    except Exception as e:  # pylint: disable=broad-except
      data["autotune"] = {"name": cases[0].name,
                          "error": common.short_error(e)}
  print(save(), flush=True)


if __name__ == "__main__":
  app.run(main)
