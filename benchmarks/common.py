"""What ag_bench.py and rs_bench.py share: flags, cases, schedules, reports.

One bench script = one op. For every case (global M, K, N) and axis size W it
times the op's baselines and every candidate schedule, checks each result
against an f32 reference once, and rewrites its JSON after every method, so a
run killed by a time limit (or a hang) still leaves every finished number and
says what it was doing (``in_progress``).
"""

from __future__ import annotations

import dataclasses
import functools
import datetime
import gc
import json
import os
import platform
import socket
import sys
import time
import traceback
from typing import Any, Callable

from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = os.path.join(HERE, "shapes.json")
DEFAULT_OUT_DIR = os.path.join(HERE, "results")

FLAGS = flags.FLAGS


def define_flags(*, default_peers: str) -> None:
  """Flags common to both bench scripts."""
  flags.DEFINE_list("models", ["llama3-70b", "llama3-8b"],
                    "Model names from shapes.json ('all' for every model).")
  flags.DEFINE_list("tokens", ["8192", "4096", "16384"],
                    "Token counts M (global rows).")
  flags.DEFINE_list("axis_sizes", ["4"],
                    "Mesh sizes W; each uses the first W devices.")
  flags.DEFINE_bool("square", True, "Also run shapes.json's square_cases.")
  flags.DEFINE_list("cases", [],
                    "Extra cases 'MxKxN' (global sizes; see the op's docstring"
                    " for which is the contraction).")
  flags.DEFINE_list(
      "schedules", ["quick"],
      "Schedules to time: presets 'all', 'quick', 'default' (schedule=None"
      " only), and/or labels 'default', 'none' or"
      " 'dataflow/cN[/comm[/compute]]', e.g. 'direct/c2/dma,ring/c1/xla'.")
  flags.DEFINE_list("comms", ["auto"],
                    "Communication engines for presets ('auto': dma,xla).")
  flags.DEFINE_list("peers", default_peers.split(",") if default_peers else [],
                    "Other implementations to time (mosaic; torch runs in"
                    " torch_async_tp.py and is merged by plot.py).")
  flags.DEFINE_list("mosaic_configs", ["128x128x64x4", "128x256x64x4"],
                    "Mosaic GPU tile search: tile_m x tile_n x tile_k x"
                    " stages.")
  flags.DEFINE_string("out_dir", DEFAULT_OUT_DIR, "Where results go.")
  flags.DEFINE_string("tag", None, "Result file tag (default: platform_Wdev).")
  flags.DEFINE_string("shapes", DEFAULT_SHAPES, "shapes.json path.")
  flags.DEFINE_float("time_budget_s", 0.0,
                     "Stop starting cases (and methods) after this many"
                     " seconds; 0: no limit.")
  flags.DEFINE_integer("warmup", 3, "Warm-up calls (the first compiles).")
  flags.DEFINE_integer("rounds", 5, "Timed rounds.")
  flags.DEFINE_integer("iters", 20, "Back-to-back calls per round (at least).")
  flags.DEFINE_float("min_round_ms", 25.0,
                     "Raise the calls per round of short ops until a round"
                     " lasts this long (timing.set_min_round_ms); 0: exactly"
                     " --iters.")
  flags.DEFINE_float("settle_ms", 10.0,
                     "Interleaved timing: untimed calls of a program for this"
                     " long before each of its timed rounds"
                     " (timing.set_settle_ms; at least one call).")
  flags.DEFINE_enum("order", "shuffle", ["shuffle", "rotate"],
                    "Interleaved timing: each round in a fresh random order"
                    " (shuffle) or the same cyclic order rotated (rotate, the"
                    " session-6 harness).")
  flags.DEFINE_integer("input_sets", 2, "Input sets calls rotate through.")
  flags.DEFINE_bool("tiny", False,
                    "Scale model dims down by 64 (CPU smoke tests).")
  flags.DEFINE_float("tol", 2e-2,
                     "Max relative error vs the f32 reference (bf16); a"
                     " schedule also passes within 2x XLA's own error.")
  flags.DEFINE_bool("check", True, "Check correctness once per case.")
  flags.DEFINE_bool("interleave", False,
                    "Time a case's baselines and schedules round-robin"
                    " (timing.interleaved) instead of one after another.")


# ---------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  m: int  # Global rows (tokens).
  k: int  # Contraction.
  n: int  # Output columns.


def _tiny(d: int) -> int:
  return max(32, (d // 64) // 32 * 32)


def build_cases(op: str, *, shapes_path: str | None = None,
                models: list[str] | None = None,
                tokens: list[str] | None = None, square: bool | None = None,
                extra: list[str] | None = None,
                tiny: bool | None = None) -> list[Case]:
  """Cases, de-duplicated, in the given order (most wanted first).

  Order: ``extra`` ('MxKxN', named after a model or square case when they
  match one), then models x tokens, then square cases. Arguments left None
  come from the flags. all_gather_matmul ("ag"): model
  (H, F) -> K=H, N=F. matmul_reduce_scatter ("rs"): K=F, N=H. Square cases
  [M, K, N] are used as given. ``tiny`` divides model dims by 64 (rounded to
  a multiple of 32) and square M by 64, for CPU smoke tests.
  """
  shapes_path = shapes_path or FLAGS.shapes
  models = FLAGS.models if models is None else models
  tokens = FLAGS.tokens if tokens is None else tokens
  square = FLAGS.square if square is None else square
  extra = FLAGS.cases if extra is None else extra
  tiny = FLAGS.tiny if tiny is None else tiny
  with open(shapes_path) as f:
    shapes = json.load(f)
  all_models = shapes["models"]
  names = list(all_models) if list(models) == ["all"] else list(models)
  scale = _tiny if tiny else (lambda d: d)
  cases: list[Case] = []
  # Explicit cases first: they are the ones asked for by hand.
  for spec in extra:
    m, k, n = (int(v) for v in spec.lower().split("x"))
    name = f"custom/{m}x{k}x{n}"
    for model, d in all_models.items():
      if (k, n) == ((d["H"], d["F"]) if op == "ag" else (d["F"], d["H"])):
        name = f"{model}/M{m}"
    if m == k == n or (m, k, n) in [tuple(c) for c in
                                    shapes.get("square_cases", [])]:
      name = f"square/{m}x{k}x{n}"
    cases.append(Case(name, m, k, n))
  for name in names:
    if name not in all_models:
      raise ValueError(
          f"Unknown model {name!r}; shapes.json has {list(all_models)}.")
    h, f_ = scale(all_models[name]["H"]), scale(all_models[name]["F"])
    k, n = (h, f_) if op == "ag" else (f_, h)
    for m in (int(t) for t in tokens):
      cases.append(Case(f"{name}/M{m}", m, k, n))
  if square:
    for m, k, n in shapes.get("square_cases", []):
      m, k, n = (m // 64, scale(k), scale(n)) if tiny else (m, k, n)
      cases.append(Case(f"square/{m}x{k}x{n}", m, k, n))
  seen, out = set(), []
  for c in cases:
    if (c.m, c.k, c.n) not in seen:
      seen.add((c.m, c.k, c.n))
      out.append(c)
  return out


# ---------------------------------------------------------------- schedules


def configure_timing() -> None:
  """The timing module's settings from this module's flags."""
  import timing  # pylint: disable=g-import-not-at-top
  timing.set_min_round_ms(FLAGS.min_round_ms)
  timing.set_settle_ms(FLAGS.settle_ms)
  timing.set_order(FLAGS.order)


def required_cases() -> list[Case]:
  """``--cases`` (`parse_cases`), at least one; a usage error otherwise."""
  from absl import app  # pylint: disable=g-import-not-at-top
  try:
    cases = parse_cases(FLAGS.cases)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if not cases:
    raise app.UsageError("--cases [name:]MxKxN[,...] is required.")
  return cases


def parse_cases(items: list[str]) -> list[Case]:
  """``--cases`` items ``"MxKxN"`` or ``"name:MxKxN"`` (global sizes).

  Raises:
    ValueError: naming the item that is neither.
  """
  cases = []
  for item in items:
    name, _, dims = item.rpartition(":")
    try:
      m, k, n = (int(d) for d in dims.split("x"))
    except ValueError:
      raise ValueError(f"--cases item {item!r}: expected [name:]MxKxN, e.g."
                       " llama3-8b/M4096:4096x14336x4096.") from None
    cases.append(Case(name=name or dims, m=m, k=k, n=n))
  return cases


def platform_name() -> str:
  import jax
  return jax.devices()[0].platform


def schedule_from_label(label: str):
  """``'dataflow/cN[/comm[/compute[/smK][/piece|step]]]'`` -> a ficco_jax.Schedule."""
  import ficco_jax
  return ficco_jax.Schedule.from_short(label)


def parse_schedules(spec: list[str]) -> list[tuple[str, Any]]:
  """(label, Schedule or None) pairs; None is the library's default choice."""
  import ficco_jax

  comms = FLAGS.comms
  if comms == ["auto"]:
    comms = ["dma", "xla"]
  primary = comms[0]
  out: list[tuple[str, Any]] = []

  def add(label, sched):
    if label not in [l for l, _ in out]:
      out.append((label, sched))

  for item in spec:
    item = item.strip()
    if item == "default":
      add("default", None)
    elif item == "quick":
      # Modest by default (every schedule is a compile): the default, each
      # dataflow at a few chunk counts on the primary engine, and the XLA
      # other engines at two points for comparison.
      add("default", None)
      picks = [("direct", 1), ("direct", 2), ("direct", 4), ("ring", 1),
               ("bidirectional", 1), ("bidirectional", 2)]
      for df, c in picks:
        s = ficco_jax.Schedule(dataflow=df, num_chunks=c, comm=primary)
        add(s.short(), s)
      for comm in comms[1:]:
        for df, c in [("direct", 2), ("ring", 1)]:
          s = ficco_jax.Schedule(dataflow=df, num_chunks=c, comm=comm)
          add(s.short(), s)
    elif item == "all":
      add("default", None)
      for comm in comms:
        for df in ("direct", "ring", "bidirectional"):
          for c in (1, 2, 4):
            s = ficco_jax.Schedule(dataflow=df, num_chunks=c, comm=comm)
            add(s.short(), s)
      s = ficco_jax.Schedule(dataflow="none", num_chunks=1)
      add(s.short(), s)
    elif item == "none":
      s = ficco_jax.Schedule(dataflow="none", num_chunks=1)
      add(s.short(), s)
    else:
      # "label@mode" runs that schedule under a peer-copy issue mode
      # (with_issue_mode); "default@mode" the library's choice.
      base, _, mode = item.partition("@")
      suffix = f"@{mode}" if mode else ""
      if base == "default":
        add("default" + suffix, None)
      else:
        s = schedule_from_label(base)
        add(s.short() + suffix, s)
  return out


_initial_issue_mode: dict[str, str] = {}


def with_issue_mode(fn, label: str):
  """``fn`` that first selects the peer-copy issue mode of ``label``'s
  ``@mode`` suffix, or else the process's initial mode, so candidates of
  different modes can be timed interleaved (a mode changes only between
  blocks, when nothing is in flight). One ctypes call per call, ~1 us."""
  import jax
  from ficco_jax._src.dma import library

  platform = "cuda" if jax.devices()[0].platform == "gpu" else "cpu"
  if platform not in _initial_issue_mode:
    _initial_issue_mode[platform] = library.issue_mode(platform)
  mode = label.partition("@")[2] or _initial_issue_mode[platform]

  def call(*args):
    library.set_issue_mode(mode, platform)
    return fn(*args)
  return call


# ---------------------------------------------------------------- jax helpers


def mesh_of(w: int):
  import jax
  import numpy as np
  devs = jax.devices()
  if w > len(devs):
    raise ValueError(f"axis size {w} > {len(devs)} devices")
  return jax.sharding.Mesh(np.array(devs[:w]), ("x",))


def random_array(mesh, shape, spec, key: int, dtype=None):
  """Random normal array made on the devices, laid out as `spec`."""
  import jax
  import jax.numpy as jnp
  dtype = dtype or jnp.bfloat16
  sharding = jax.sharding.NamedSharding(mesh, spec)
  gen = jax.jit(lambda k: jax.random.normal(k, shape, dtype),
                out_shardings=sharding)
  return gen(jax.random.key(key))


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| in f32 (NaN stays NaN and fails the check)."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def f(a, b):
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)

  return float(f(out, ref))


def shard_map(fn, mesh, in_specs, out_specs, check_vma=True):
  import jax
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def short_error(e: BaseException, limit: int = 1500) -> str:
  msg = f"{type(e).__name__}: {e}"
  if len(msg) > limit:
    msg = msg[: limit // 2] + " ... " + msg[-limit // 2:]
  return msg


# ---------------------------------------------------------------- host threads


def threads() -> dict[int, dict]:
  """Scheduler counters of every thread of this process, by tid."""
  out = {}
  base = "/proc/self/task"
  for tid in os.listdir(base):
    try:
      with open(f"{base}/{tid}/comm") as f:
        name = f.read().strip()
      with open(f"{base}/{tid}/schedstat") as f:
        run_ns, wait_ns, slices = (int(v) for v in f.read().split())
      with open(f"{base}/{tid}/stat") as f:
        # Field 39 (processor) counts from 1; comm (field 2) may hold spaces.
        cpu = int(f.read().rsplit(")", 1)[1].split()[36])
      ctx = {}
      with open(f"{base}/{tid}/status") as f:
        for line in f:
          if "ctxt_switches" in line:
            key, value = line.split(":")
            ctx[key.strip()] = int(value)
    except (OSError, ValueError, IndexError):
      continue  # The thread ended, or this kernel lacks schedstat.
    out[int(tid)] = dict(name=name, run_ns=run_ns, wait_ns=wait_ns,
                         slices=slices, cpu=cpu,
                         vol=ctx.get("voluntary_ctxt_switches", 0),
                         invol=ctx.get("nonvoluntary_ctxt_switches", 0))
  return out


# ---------------------------------------------------------------- run state


def env_info(op: str) -> dict[str, Any]:
  import jax
  info: dict[str, Any] = {
      "op": op,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "command": " ".join([sys.executable] + sys.argv),
      "host": socket.gethostname(),
      "python": platform.python_version(),
      "jax": jax.__version__,
  }
  try:
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    import ficco_jax
    info["ficco_jax"] = getattr(ficco_jax, "__version__", "unknown")
    info["ficco_jax_file"] = getattr(ficco_jax, "__file__", None)
    from ficco_jax._src import heuristics  # Diagnostics only.
    info["dma_available"] = heuristics.dma_available(jax.devices()[0].platform)
  except Exception as e:  # pylint: disable=broad-except
    info["ficco_jax"] = f"import failed: {short_error(e)}"
  devs = jax.devices()
  info["platform"] = devs[0].platform
  info["device_kind"] = devs[0].device_kind
  info["device_count"] = len(devs)
  info["env"] = {k: os.environ.get(k) for k in (
      "XLA_FLAGS", "JAX_PLATFORMS", "NCCL_NVLS_ENABLE",
      "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
      "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES")}
  # The library's switches (e.g. FICCO_FLAGGED_TRANSPORT) change what runs.
  info["env"].update({k: v for k, v in os.environ.items()
                      if k.startswith("FICCO_")})
  info["timing"] = {"warmup": FLAGS.warmup, "rounds": FLAGS.rounds,
                    "iters": FLAGS.iters, "min_round_ms": FLAGS.min_round_ms,
                    "settle_ms": FLAGS.settle_ms, "order": FLAGS.order,
                    "input_sets": FLAGS.input_sets,
                    "interleave": FLAGS.interleave,
                    "stat": "median and min over rounds of round_time / iters"}
  return info


class Run:
  """Holds one bench run's results and rewrites its JSON/markdown eagerly."""

  def __init__(self, op: str, title: str, md_row: Callable[[dict], str],
               md_header: str):
    import jax
    configure_timing()
    self.op = op
    self.title = title
    self.md_row = md_row
    self.md_header = md_header
    self.t0 = time.perf_counter()
    tag = FLAGS.tag or f"{jax.devices()[0].platform}_{len(jax.devices())}dev"
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    self.json_path = os.path.join(FLAGS.out_dir, f"{op}_{tag}.json")
    self.md_path = os.path.join(FLAGS.out_dir, f"{op}_{tag}.md")
    self.data: dict[str, Any] = {
        "meta": env_info(op), "cases": [], "skipped": [], "in_progress": None,
        "budget_s": FLAGS.time_budget_s,
    }

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def over_budget(self) -> bool:
    return FLAGS.time_budget_s > 0 and self.elapsed() > FLAGS.time_budget_s

  def progress(self, what: str | None) -> None:
    self.data["in_progress"] = what
    if what:
      print(f"[{self.elapsed():7.1f}s] {what}", flush=True)
    self.save()

  def save(self) -> None:
    self.data["elapsed_s"] = self.elapsed()
    tmp = self.json_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1, default=str)
    os.replace(tmp, self.json_path)
    with open(self.md_path, "w") as f:
      f.write(self.markdown())

  def markdown(self) -> str:
    meta = self.data["meta"]
    lines = [
        f"# {self.title}",
        "",
        f"{meta['device_count']} x {meta['device_kind']} ({meta['platform']}),"
        f" jax {meta['jax']}, {meta['date']}",
        f"`{meta['command']}`",
        "",
        "Times in ms per call: median over rounds (min in parentheses)."
        " Speedup is over the XLA collective + dot in shard_map; ideal is"
        " max(matmul alone, collective alone).",
        "",
        self.md_header,
    ]
    for c in self.data["cases"]:
      try:
        lines.append(self.md_row(c))
      except Exception as e:  # pylint: disable=broad-except
        lines.append(f"| {c.get('name')} | row failed: {short_error(e, 200)} |")
    if self.data["skipped"]:
      lines += ["", "Skipped:"]
      lines += [f"- {s['name']} W={s.get('W')}: {s['reason']}"
                for s in self.data["skipped"]]
    # Failures grouped by message, so one missing feature is one line.
    failures: dict[str, list[str]] = {}
    for c in self.data["cases"]:
      for m in c.get("methods", []):
        if m.get("error") or m.get("ok") is False:
          msg = m.get("error") or "WRONG RESULT rel_err=%.3g" % m["rel_err"]
          failures.setdefault(msg, []).append(
              f"{c['name']} W={c['W']} {m['method']} {m.get('label', '')}")
    if failures:
      lines += ["", "Failures:"]
      for msg, where in failures.items():
        lines.append(f"- {len(where)}x `{msg[:300]}`: {', '.join(where[:6])}"
                     + (" ..." if len(where) > 6 else ""))
    return "\n".join(lines) + "\n"


def timed(run: Run, label: str, fn: Callable[[], dict]) -> dict:
  """Runs one measurement; an exception becomes a recorded error."""
  run.progress(label)
  t0 = time.perf_counter()
  try:
    res = fn()
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc(limit=4)
    res = {"error": short_error(e)}
  res["wall_s"] = time.perf_counter() - t0
  gc.collect()
  return res


def summarize_case(c: dict) -> None:
  """Adds ideal, speedups, fraction of ideal and bests to a case record."""
  b = c["baselines"]
  t_mm = b.get("matmul", {}).get("median_ms")
  t_comm = b.get("comm", {}).get("median_ms")
  t_xla = b.get("xla", {}).get("median_ms")
  ideal = max(t_mm, t_comm) if t_mm and t_comm else None
  c["ideal_ms"] = ideal
  c["t_seq_ms"] = t_xla
  c["ideal_speedup"] = t_xla / ideal if ideal and t_xla else None
  for m in c["methods"]:
    t = m.get("median_ms")
    if t:
      m["speedup_vs_xla"] = t_xla / t if t_xla else None
      m["speedup_vs_xla_min"] = (b["xla"]["min_ms"] / m["min_ms"]
                                 if t_xla else None)
      m["frac_ideal"] = ideal / t if ideal else None
      m["exposed_ms"] = t - t_mm if t_mm else None

  def best(pred):
    ok = [m for m in c["methods"] if pred(m) and m.get("median_ms")
          and m.get("ok", True) is not False]
    return min(ok, key=lambda m: m["median_ms"]) if ok else None

  for key, pred in (
      ("ficco_default", lambda m: m["method"] == "ficco"
       and m["label"] == "default"),
      ("ficco_best", lambda m: m["method"] == "ficco"),
      ("mosaic_best", lambda m: m["method"] == "mosaic"),
  ):
    m = best(pred)
    c[key] = None if m is None else {
        k: m.get(k) for k in ("label", "resolved", "median_ms", "min_ms",
                              "speedup_vs_xla", "frac_ideal")}


def fmt(t: float | None, digits: int = 3) -> str:
  return "-" if t is None else f"{t:.{digits}f}"


def md_row(c: dict) -> str:
  """Markdown row shared by both ops."""
  b = c["baselines"]

  def t(d):
    if not d or d.get("median_ms") is None:
      return "err" if d and d.get("error") else "-"
    return f"{d['median_ms']:.3f} ({d['min_ms']:.3f})"

  def m(d, with_label=False):
    if not d:
      return "-"
    s = f"{d['median_ms']:.3f} ({fmt(d['speedup_vs_xla'], 2)}x)"
    if d.get("resolved"):
      return f"{s} = `{d['resolved']}`"
    return f"{s} `{d['label']}`" if with_label else s

  errs = [mm.get("rel_err") for mm in c["methods"]
          if mm.get("rel_err") is not None]
  bad = sum(1 for mm in c["methods"] if mm.get("ok") is False)
  failed = sum(1 for mm in c["methods"] if mm.get("error"))
  return (f"| {c['name']} | {c['W']} | {c['M']}x{c['K']}x{c['N']} |"
          f" {t(b.get('matmul'))} | {t(b.get('comm'))} | {t(b.get('xla'))} |"
          f" {fmt(c.get('ideal_ms'))} ({fmt(c.get('ideal_speedup'), 2)}x) |"
          f" {m(c.get('ficco_default'))} | {m(c.get('ficco_best'), True)} |"
          f" {m(c.get('mosaic_best'), True)} |"
          f" {fmt(max(errs) if errs else None, 4)} | {bad}/{failed} |")


MD_HEADER = (
    "| case | W | M x K x N | matmul | {comm} | XLA {comm}+dot | ideal (x) |"
    " ficco default (x) | ficco best (x) | mosaic best (x) | max rel err |"
    " wrong/failed |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|")


def run_all(run: Run, bench_case: Callable[[Run, Case, int], dict | None],
            op: str) -> None:
  """The case loop: budget, skips, per-case error isolation, eager saves."""
  cases = build_cases(op)
  axis_sizes = [int(w) for w in FLAGS.axis_sizes]
  run.data["planned"] = [
      {"name": c.name, "W": w} for w in axis_sizes for c in cases]
  for w in axis_sizes:
    for case in cases:
      if run.over_budget():
        run.data["skipped"].append(
            {"name": case.name, "W": w, "reason": "time budget exceeded"})
        continue
      try:
        import timing  # pylint: disable=import-outside-toplevel
        with timing.interleaved(FLAGS.interleave):
          rec = bench_case(run, case, w)
          if rec is not None and FLAGS.interleave:
            run.progress(f"{case.name} W={w}: timing round-robin")
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        run.data["skipped"].append(
            {"name": case.name, "W": w, "reason": short_error(e)})
        rec = None
      if rec is not None:
        summarize_case(rec)
        run.data["cases"].append(rec)
        print(run.md_row(rec), flush=True)
      run.progress(None)
      _free()
  run.progress(None)
  print(run.markdown(), flush=True)
  print(f"wrote {run.json_path} and {run.md_path}", flush=True)


def _free() -> None:
  import jax
  gc.collect()
  jax.clear_caches()


def check_record(m: dict, out, ref32, xla_err: float | None) -> None:
  """Adds rel_err (vs f32 reference) and ok to a method record."""
  err = rel_err(out, ref32)
  m["rel_err"] = err
  limit = max(FLAGS.tol, 2 * xla_err) if xla_err is not None else FLAGS.tol
  m["ok"] = bool(err == err and err <= limit)  # err == err: not NaN.


def rs_specs():
  """(in_specs, out_spec) of the reduce-scatter probes on axis "x": h
  column-sharded, w row-sharded, the result row-sharded."""
  from jax.sharding import PartitionSpec as P
  return (P(None, "x"), P("x", None)), P("x", None)


def xla_rs(a, b):
  """XLA's reduce-scatter matmul, the probes' baseline (in shard_map)."""
  from jax import lax
  return lax.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True)


def ficco_rs(label: str):
  """ficco's reduce-scatter matmul on axis "x" with schedule ``label``
  (``"default"``: schedule=None), for shard_map."""
  import ficco_jax
  sched = None if label == "default" else schedule_from_label(label)
  return functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                           schedule=sched)


def trivial_program(mesh, in_specs):
  """The floor of any program on the mesh, and so the host's own speed:
  dispatch and one element-wise kernel per device, no collective."""
  return jit_shard_map(lambda a, b: a * 2, mesh, in_specs, in_specs[0])


def jit_shard_map(body, mesh, in_specs, out_specs, check_vma=True):
  import jax
  return jax.jit(shard_map(body, mesh, in_specs, out_specs, check_vma))


def first_call(build, args):
  """Compiles and runs once; retries with check_vma=False if VMA rejects it.

  Args:
    build: ``build(check_vma) -> jitted fn``.
    args: one argument tuple.

  Returns:
    (fn, out, compile_s, notes).
  """
  import jax
  notes = {}
  fn = build(True)
  t0 = time.perf_counter()
  try:
    out = jax.block_until_ready(fn(*args))
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e).lower()
    if "vma" not in msg and "varying" not in msg:
      raise
    notes["check_vma"] = f"False (True failed: {short_error(e, 300)})"
    fn = build(False)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
  return fn, out, time.perf_counter() - t0, notes


def measure(build, *, args, ref32, xla_err, tk) -> dict:
  """Compile + check once against the f32 reference, then time."""
  from timing import time_jax
  fn, out, compile_s, notes = first_call(build, args[0])
  res = dict(notes)
  res["compile_s"] = compile_s
  if ref32 is not None:
    check_record(res, out, ref32, xla_err)
  del out
  timed_res = time_jax(fn, args, **tk)
  # Interleaved timing fills timed_res later: keep it as the record itself.
  timed_res.update(res)
  return timed_res


def resolve_default(op: str, *, x_shape, w_shape, axis_size: int) -> str:
  """What schedule=None becomes for these local shapes, and from where."""
  try:
    import jax.numpy as jnp
    from ficco_jax._src import api  # The resolver the ops themselves use.
    schedule, source = api.default_schedule(
        op, x_shape=tuple(x_shape), w_shape=tuple(w_shape), dtype=jnp.bfloat16,
        axis_size=axis_size, axis=0)
    return f"{schedule.short()} ({source})"
  except Exception as e:  # pylint: disable=broad-except
    return f"unknown ({short_error(e, 200)})"


def run_ficco(run: Run, rec: dict, tag: str, op: str, mesh, in_specs, out_spec,
              measure_fn, *, resolve_kw: dict) -> None:
  """Times ficco_jax.<op> with every candidate schedule into rec['methods']."""
  try:
    import ficco_jax
    schedules = parse_schedules(FLAGS.schedules)
  except Exception as e:  # pylint: disable=broad-except
    rec["methods"].append({"method": "ficco", "label": "*",
                           "error": short_error(e)})
    return
  rec["default_schedule"] = resolve_default(op, **resolve_kw)
  op_fn = getattr(ficco_jax, op)
  # With any "@mode" candidate, every candidate selects its mode per call.
  any_mode = any("@" in label for label, _ in schedules)
  for label, sched in schedules:
    if run.over_budget():
      rec["skipped_methods"].append(f"ficco {label}: time budget")
      continue

    def build(check_vma, sched=sched, label=label):
      body = functools.partial(op_fn, axis_name="x", schedule=sched)
      fn = jit_shard_map(body, mesh, in_specs, out_spec, check_vma)
      return with_issue_mode(fn, label) if any_mode else fn
    res = timed(run, f"{tag} ficco {label}",
                lambda build=build: measure_fn(build))
    entry = res  # In place: interleaved timing fills this very dict later.
    entry.update({"method": "ficco", "label": label})
    if sched is None:
      entry["resolved"] = rec["default_schedule"]
    rec["methods"].append(entry)
