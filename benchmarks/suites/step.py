"""Suite ``step``: a tensor-parallel transformer's training step or prefill.

The model is examples/tp_transformer.py (Megatron sequence parallelism on a
``dp x tp`` mesh, pjit style; ``--layers`` blocks under ``lax.scan``,
``--remat`` to rematerialize them). One step is forward + backward + Adam
update, jitted with the parameters and optimizer state donated
(``--step_mode=train``), or the forward pass and loss alone
(``--step_mode=forward``: prefill). Each variant reports tokens/s, its model
TFLOP/s per device and, where the device's dense bf16 peak is known (`PEAK`),
MFU (model flops: `tp_transformer.flops_per_step`). Variants:

  ficco  the four tensor-parallel matmuls through ficco_jax.sharded (the
         first ``--schedules`` label; default: the library's choice);
  xla    plain ``x @ w`` with the same sharding constraints, so XLA inserts
         the all-gathers and reduce-scatters (and overlaps what it can);
  xla_overlap
         the same compiled with XLA's latency-hiding scheduler and
         windowed-einsum options (lib/programs.py OVERLAP_OPTIONS). The
         speedups are over ``xla_best``: the faster of the two XLA variants
         whose first loss matches the other's (or ``xla``'s alone);
  ficco_tuned
         ``ficco`` with ``schedule=None`` after `ficco_jax.autotune_model`
         tuned the step's four matmul sites (``--tune_candidates``) into a
         fresh cache file: the tuning's own report (sites, before/after,
         the step gain it measured) is recorded with it. Its peak memory
         includes the tuning's (two compiled steps, each site's operands).

Timing: lib/timing.py's method; in training the state is threaded through
the calls (`timing.time_chain`, ``--iters`` calls per round), in forward
mode the calls are independent (`timing.time_jax`, which lengthens a round
to ``--min_round_ms``). While a variant is timed, nvidia-smi samples the
GPUs' SM clocks, power and clock-limit reasons (lib/gpu_monitor.py): a step
slower when timed than when traced, or one GPU slower at every kernel, is
often a clock limit, not the program. By default each variant is timed in
its own process, one after the other; ``--step_interleave`` builds them all
in one process and times them round-robin (`timing.time_chains`), as the
ops suite does, so that each sees the same clocks and heat (peak memory is
then cumulative: take it from a run without). Each variant records its
warm-up losses (same seed, same data): the report says whether the first
ones agree.

Peak memory: each variant runs in a fresh subprocess of this command, so
each device's ``peak_bytes_in_use`` is that variant's own (parameters,
optimizer state, scratch, steps); ``--nostep_subprocess`` runs both in this
process (then peaks are cumulative; ``memory_mode`` says which). The
compiled step's ``memory_analysis()`` is recorded too (CPU runs have no
allocator statistics), and ``--memory_report`` keeps XLA's memory-usage
report of each variant's step program (which buffers are live at its
peak: where a variant's extra memory goes).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from absl import flags

from lib import gpu_monitor
from lib import meta as meta_lib
from lib import options
from lib import programs
from lib import report
from lib import results
from lib import schedules as schedules_lib
from lib import timing

FLAGS = flags.FLAGS
EXAMPLES = os.path.join(meta_lib.REPO, "examples")

flags.DEFINE_integer("d_model", 8192, "step: model width.")
flags.DEFINE_integer("heads", 64, "step: attention heads (divisible by tp).")
flags.DEFINE_integer("d_ff", 28672, "step: MLP width (divisible by tp).")
flags.DEFINE_integer("seq", 8192, "step: sequence length.")
flags.DEFINE_integer("layers", 1, "step: transformer blocks (lax.scan).")
flags.DEFINE_bool("remat", False, "step: rematerialize each block in the"
                  " backward pass.")
flags.DEFINE_enum("step_mode", "train", ["train", "forward"],
                  "step: the training step, or the forward pass alone"
                  " (prefill).")
flags.DEFINE_integer("batch", 1, "step: global batch (divisible by dp).")
flags.DEFINE_string("dtype", "bfloat16", "step: compute dtype (parameters"
                    " float32).")
flags.DEFINE_enum("attention", "xla", ["xla", "cudnn"],
                  "step: the example's einsum softmax, or cuDNN's fused"
                  " attention (GPU, bf16); the same in both variants.")
flags.DEFINE_integer("dp", None, "step: data-parallel size (GPU default 1).")
flags.DEFINE_integer("tp", None, "step: tensor-parallel size (default: all"
                     " GPUs; CPU 4).")
flags.DEFINE_list("variants", ["ficco", "xla", "xla_overlap"],
                  "step: variants to time (ficco, xla, xla_overlap,"
                  " ficco_tuned).")
flags.DEFINE_float("lr", 1e-4, "step: Adam learning rate.")
flags.DEFINE_list("tune_candidates", [
    "none", "direct/c1/dma/xla", "direct/c2/dma/xla", "direct/c1/dma/pallas",
    "direct/c2/dma/pallas", "direct/c1/dma/pallas/flagged"],
                  "step: the schedules ficco_tuned's autotune_model times at"
                  " every site (those that do not fit a site are skipped"
                  " there).")
flags.DEFINE_bool("step_subprocess", True, "step: each variant in a fresh"
                  " process (clean peak memory).")
flags.DEFINE_bool("step_interleave", False, "step: build every variant in"
                  " one process and time them round-robin, as the ops suite"
                  " times its programs (same clocks and heat for each;"
                  " peaks are then cumulative).")
flags.DEFINE_integer("variant_timeout_s", 300, "step: one variant's limit.")
flags.DEFINE_bool("memory_report", False, "step: write XLA's memory-usage"
                  " report of each variant's step program (the buffers live"
                  " at its peak; the largest program XLA compiled) to"
                  " step_memory_<variant>.txt; dumping every program makes"
                  " the compile time longer.")
flags.DEFINE_integer("profile_steps", 0, "step: after timing, trace this many"
                     " steps and write the trace summary (with the last"
                     " step's whole timeline on the first GPU) to"
                     " step_profile_<variant>.txt.")
# Set on the subprocesses.
flags.DEFINE_string("step_variant", None, "Internal: run only this variant.")
flags.DEFINE_string("step_result_file", None, "Internal: where it writes.")

CPU_DEVICES = "--xla_force_host_platform_device_count=8"
# Dense bf16 peak per device (datasheet, no sparsity) for MFU.
PEAK = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}
VARIANTS = ("ficco", "xla", "xla_overlap", "ficco_tuned")
INTERLEAVED = "interleaved"  # --step_variant of --step_interleave's process.


def sizes() -> dict:
  """Model and run sizes after --tiny (CPU: d_model 64, f32, 1 round)."""
  s = dict(d_model=FLAGS.d_model, heads=FLAGS.heads, d_ff=FLAGS.d_ff,
           seq=FLAGS.seq, batch=FLAGS.batch, dtype=FLAGS.dtype,
           layers=FLAGS.layers, remat=FLAGS.remat, mode=FLAGS.step_mode,
           warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)
  if FLAGS.tiny:
    s.update(d_model=64, heads=8, d_ff=256, seq=64, batch=None,
             dtype="float32", warmup=2, rounds=1, iters=2)
  return s


def _memory(devices) -> list[dict]:
  out = []
  for d in devices:
    stats = d.memory_stats() or {}
    out.append({k: stats.get(k) for k in
                ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")})
  return out


def _resolved(cfg, dp, tp, batch, seq) -> dict:
  """What schedule=None runs for the block's four matmuls (ficco_jax.explain)."""
  import ficco_jax
  b, d, f = batch // dp, cfg.d_model, cfg.d_ff
  problems = {"qkv": ("all_gather_matmul", (b, seq // tp, d), (d, 3 * d // tp)),
              "up": ("all_gather_matmul", (b, seq // tp, d), (d, f // tp)),
              "out": ("matmul_reduce_scatter", (b, seq, d // tp), (d // tp, d)),
              "down": ("matmul_reduce_scatter", (b, seq, f // tp), (f // tp, d))}
  out = {}
  for name, (op, x, w) in problems.items():
    try:
      e = ficco_jax.explain(op, x_shape=x, w_shape=w, dtype=cfg.dtype,
                            axis_size=tp, axis=1)
      out[name] = f"{e.chosen.short()} ({e.source})"
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"unknown ({results.short_error(e, 200)})"
  return out


def _autotune(tpt, cfg, mesh, params, opt, batch) -> dict:
  """`ficco_jax.autotune_model` on the (undonated) step, into a fresh cache
  file this process then reads."""
  import ficco_jax
  ficco_jax.set_autotune_cache(os.path.join(tempfile.mkdtemp(),
                                            "autotune.json"))
  step = tpt.make_train_step(cfg, mesh, use_ficco=True, lr=FLAGS.lr)
  candidates = [s for _, s in schedules_lib.parse(FLAGS.tune_candidates)]
  sz = sizes()
  t0 = time.perf_counter()
  r = ficco_jax.autotune_model(step, params, opt, *batch,
                               candidates=candidates, rounds=sz["rounds"],
                               iters=sz["iters"])
  return {"seconds": time.perf_counter() - t0,
          "step_ms_before": r.step_ms_before,
          "step_ms_after": r.step_ms_after, "speedup": r.speedup,
          "stored": r.stored, "note": r.note, "report": r.report(),
          "sites": [{"site": s.site.describe(), "calls": s.calls,
                     "before": s.before.short(), "tuned": s.tuned.best.short(),
                     "op_speedup": s.speedup,
                     "timings_ms": dict(s.tuned.timings_ms),
                     "errors": dict(s.tuned.errors)} for s in r.sites]}


def throughput(flops: float, tokens: int, step_s: float, num_devices: int,
               device_kind: str, dtype: str) -> dict:
  """tokens/s (the global batch's), model TFLOP/s per device, and MFU
  against the kind's dense bf16 peak (`PEAK`; None for other kinds or
  dtypes)."""
  per_device = flops / step_s / num_devices
  peak = PEAK.get(device_kind) if dtype == "bfloat16" else None
  return {"tokens_per_s": tokens / step_s,
          "model_tflops_per_device": per_device / 1e12,
          "mfu": per_device / peak if peak else None}


@dataclasses.dataclass
class _Built:
  """One variant compiled and warmed up in this process: what timing it
  and reporting it need (``state`` advances as it is timed)."""

  name: str
  res: dict
  compiled: Any
  train: bool
  state: tuple
  batches: list
  cfg: Any
  batch: int
  devices: list
  sz: dict
  tpt: Any
  mesh: Any
  ops: dict  # use_ficco and schedule, as the step was built with.

  def step(self, s, x, y):
    """One training step of the threaded ``(params, opt, loss)`` state."""
    return self.compiled(s[0], s[1], x, y)

  def forward_sets(self) -> list[tuple]:
    """The prefill's argument sets: the parameters with each batch."""
    return [(self.state[0], x, y) for x, y in self.batches]


def _build(name: str) -> _Built:
  """Builds, compiles and warms up one variant in this process."""
  import jax
  import jax.numpy as jnp
  sys.path.insert(0, EXAMPLES)
  import tp_transformer as tpt  # pylint: disable=g-import-not-at-top

  sz = sizes()
  dp = FLAGS.dp
  if jax.default_backend() != "cpu" and dp is None:
    dp = 1
  dp, tp = tpt.default_mesh_shape(dp, FLAGS.tp)
  mesh = tpt.make_mesh(dp, tp)
  batch = sz["batch"] or 2 * dp
  if batch % dp:
    # Before make_batch, whose sharding error names neither flag.
    raise ValueError(f"--batch={batch} must be a multiple of the"
                     f" data-parallel size {dp} (--dp, or the devices left"
                     f" after --tp={tp}).")
  cfg = tpt.Config(d_model=sz["d_model"], heads=sz["heads"], d_ff=sz["d_ff"],
                   dtype=jnp.dtype(sz["dtype"]), attention=FLAGS.attention,
                   layers=sz["layers"], remat=sz["remat"])
  train = sz["mode"] == "train"
  label, schedule = schedules_lib.parse(FLAGS.schedules)[0]
  devices = list(mesh.devices.flat)
  res = {"variant": name, "dp": dp, "tp": tp, "batch": batch,
         "schedule": "XLA collectives" if name == "xla" else label,
         "memory_before": _memory(devices)}
  if name == "ficco" and schedule is None:
    res["resolved"] = _resolved(cfg, dp, tp, batch, sz["seq"])
  params = tpt.init_params(jax.random.key(0), cfg, mesh)
  # The optimizer state only where a step updates it: in forward mode it
  # would be dead memory in the peak.
  opt = tpt.adam_init(params) if train or name == "ficco_tuned" else None
  batches = [tpt.make_batch(jax.random.key(100 + i), cfg, mesh, batch,
                            sz["seq"]) for i in range(2)]
  if name == "ficco_tuned":
    res["schedule"] = "schedule=None after autotune_model"
    res["autotune_model"] = _autotune(tpt, cfg, mesh, params, opt, batches[0])
    res["resolved"] = _resolved(cfg, dp, tp, batch, sz["seq"])
    schedule = None
  use_ficco = name not in ("xla", "xla_overlap")
  t0 = time.perf_counter()  # Tracing, lowering and compiling.
  if train:
    step = tpt.make_train_step(cfg, mesh, use_ficco=use_ficco,
                               schedule=schedule, lr=FLAGS.lr, donate=True)
    lowered = step.lower(params, opt, *batches[0])
  else:
    step = tpt.make_forward(cfg, mesh, use_ficco=use_ficco, schedule=schedule)
    lowered = step.lower(params, *batches[0])
  if name == "xla_overlap":
    res["schedule"] = "XLA collectives, overlap options"
    compiled, res["overlap"] = programs.compile_overlapped(lowered)
  else:
    compiled = lowered.compile()
  res["compile_s"] = time.perf_counter() - t0
  try:
    ma = compiled.memory_analysis()
    res["memory_analysis"] = {k: getattr(ma, k, None) for k in (
        "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
        "alias_size_in_bytes", "generated_code_size_in_bytes")}
  except Exception as e:  # pylint: disable=broad-except
    res["memory_analysis"] = f"unavailable: {e}"
  # Warm-up by hand, keeping the losses: the first is step 0 from the same
  # seed and data in both variants.
  losses = []
  for k in range(max(1, sz["warmup"])):
    if train:
      params, opt, loss = compiled(params, opt, *batches[k % 2])
    else:
      loss = compiled(params, *batches[k % 2])
    losses.append(float(loss))
  res["warmup_losses"] = losses
  return _Built(name=name, res=res, compiled=compiled, train=train,
                state=(params, opt, loss), batches=batches, cfg=cfg,
                batch=batch, devices=devices, sz=sz, tpt=tpt, mesh=mesh,
                ops=dict(use_ficco=use_ficco, schedule=schedule))


GRAD_PROJECTIONS = 16


def _grad_fingerprint(tpt, cfg, mesh, params, batch, *, use_ficco, schedule):
  """Per parameter, step 0's gradient: its norm and its projections on
  `GRAD_PROJECTIONS` seeded random directions, the same in every variant.

  The loss alone checks the forward pass; these check the backward one
  (ficco's custom VJPs) without moving whole gradients between the
  variants' processes: a gradient equal up to rounding keeps its norm and
  its projections' direction, a wrong one (a transposed or misplaced
  block) does not (`grads_match`). Its own program, not the timed step.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  specs = tpt.param_specs(cfg)

  def fingerprint(params, x, y):
    grads = jax.grad(tpt.loss_fn)(params, x, y, cfg=cfg, mesh=mesh,
                                  use_ficco=use_ficco, schedule=schedule)
    out = {}
    for i, name in enumerate(sorted(grads)):
      g = grads[name].astype(jnp.float32)

      def project(j, g=g, i=i, name=name):
        r = jax.random.normal(jax.random.fold_in(jax.random.key(1000 + i), j),
                              g.shape, jnp.float32)
        # Laid out as the gradient is, not replicated.
        r = jax.lax.with_sharding_constraint(
            r, NamedSharding(mesh, specs[name]))
        return jnp.vdot(r, g)
      out[name] = (jnp.linalg.norm(g),
                   jax.lax.map(project, jnp.arange(GRAD_PROJECTIONS)))
    return out

  got = jax.jit(fingerprint)(params, *batch)
  return {k: {"norm": float(n), "projections": [float(v) for v in p]}
          for k, (n, p) in got.items()}


def grads_match(a: dict, b: dict, rtol: float) -> str | None:
  """Why two variants' `_grad_fingerprint`s differ, or None: a norm off by
  more than ``rtol`` (at least 1e-3), or projections whose cosine is below
  0.99 (a gradient right up to rounding keeps it near 1)."""
  import math
  for name in sorted(b):
    if name not in a:
      return f"{name}: no gradient"
    na, nb = a[name]["norm"], b[name]["norm"]
    if abs(na - nb) > max(rtol, 1e-3) * abs(nb):
      return f"{name}: gradient norm {na:.6g} vs {nb:.6g}"
    pa, pb = a[name]["projections"], b[name]["projections"]
    dot = sum(u * v for u, v in zip(pa, pb))
    den = math.sqrt(sum(u * u for u in pa) * sum(v * v for v in pb))
    if den and dot / den < 0.99:
      return f"{name}: gradient direction (cosine {dot / den:.4f})"
  return None


def _time_alone(b: _Built) -> None:
  """Times one variant by itself (`timing.time_chain` / `time_jax`)."""
  sz = b.sz
  # The GPUs' clocks and power while timed: a step slower when timed than
  # when traced, or one GPU slower at every kernel, is often a clock limit.
  with gpu_monitor.Monitor() as mon:
    if b.train:
      b.state, t = timing.time_chain(
          b.step, b.state, b.batches, warmup=1, rounds=sz["rounds"],
          iters=sz["iters"])
      b.res.update(t, final_loss=float(b.state[2]))
    else:
      t = timing.time_jax(b.compiled, b.forward_sets(), warmup=1,
                          rounds=sz["rounds"], iters=sz["iters"],
                          interleave=False)
      b.res.update(t)
  b.res["gpus_while_timed"] = mon.summary


def _time_interleaved(built: list[_Built]) -> None:
  """Times the variants round-robin in one process (``--step_interleave``):
  training steps as interleaved chains (`timing.time_chains`), forward
  passes through `timing.interleaved`."""
  sz = built[0].sz
  with gpu_monitor.Monitor() as mon:
    if built[0].train:
      states, recs = timing.time_chains(
          [(b.step, b.state) for b in built], built[0].batches, warmup=1,
          rounds=sz["rounds"], iters=sz["iters"])
      for b, st, rec in zip(built, states, recs):
        b.state = st
        b.res.update(rec, final_loss=float(st[2]))
    else:
      recs = []
      with timing.interleaved():
        for b in built:
          recs.append(timing.time_jax(
              b.compiled, b.forward_sets(), warmup=1, rounds=sz["rounds"],
              iters=sz["iters"]))
      for b, rec in zip(built, recs):
        b.res.update(rec)
  for b in built:
    b.res["gpus_while_timed"] = mon.summary


def _finish(b: _Built) -> dict:
  """Throughput, memory after timing and the optional profile."""
  res, sz, devices = b.res, b.sz, b.devices
  res.update(throughput(b.tpt.flops_per_step(b.cfg, b.batch, sz["seq"],
                                             train=b.train),
                        b.batch * sz["seq"], res["median_ms"] * 1e-3,
                        len(devices), devices[0].device_kind, sz["dtype"]))
  res["memory_after"] = _memory(devices)
  peaks = [m["peak_bytes_in_use"] for m in res["memory_after"]]
  res["peak_bytes_max_over_devices"] = (
      max(peaks) if all(p is not None for p in peaks) else None)
  if b.train:
    # After the peak is read: its own program must not count in it. Step
    # 0's parameters again (the same seed), the first batch.
    import jax  # pylint: disable=g-import-not-at-top
    params = b.tpt.init_params(jax.random.key(0), b.cfg, b.mesh)
    res["grad_fingerprint"] = _grad_fingerprint(
        b.tpt, b.cfg, b.mesh, params, b.batches[0], **b.ops)
  if FLAGS.profile_steps:
    batches = b.batches
    if b.train:
      one = lambda i, s: b.step(s, *batches[i % 2])  # noqa: E731
    else:
      one = lambda i, s: (s[0], s[1],  # noqa: E731
                          b.compiled(s[0], *batches[i % 2]))
    res["profile"], res["profile_summary"], res["profile_stats"] = (
        _profile(one, b.state, b.name))
  return res


def run_variant(name: str) -> dict:
  """Builds, compiles and times one variant in this process."""
  settings = options.configure_timing()  # --min_round_ms, --settle_ms, ...
  b = _build(name)
  _time_alone(b)
  return {**_finish(b), "timing": settings}


def run_interleaved(names: list[str]) -> dict[str, dict]:
  """Every variant in this process, timed round-robin
  (``--step_interleave``); a variant that fails to build is reported and
  the others still run."""
  settings = options.configure_timing()
  built, out = [], {}
  for name in names:
    print(f"== step variant {name} (interleaved)", flush=True)
    try:
      built.append(_build(name))
    except Exception:  # pylint: disable=broad-except
      out[name] = {"variant": name, "error": traceback.format_exc()[-3000:]}
  if built:
    _time_interleaved(built)
  for b in built:
    out[b.name] = {**_finish(b), "timing": settings}
  return {n: out[n] for n in names}


def profile_summary(text: str) -> str:
  """The per-GPU lines of a trace summary (streams' busy time, copies'
  overlap, the compute stream's idle gaps), without its event timeline and
  host threads."""
  keep, timeline = [], False
  for line in text.splitlines():
    if line.startswith("## host"):
      break
    if line.startswith("## "):
      timeline = False
    elif line.lstrip().startswith("last call's timeline"):
      timeline = True
    if not timeline:
      keep.append(line)
  return "\n".join(keep)


def _profile(one, state, name: str) -> tuple[str, str, dict]:
  """Traces a few steps (``one(i, state) -> state``); returns the file the
  whole summary went to (or why it failed), its `profile_summary`, and
  the trace's per-GPU figures averaged over the GPUs (ms per step:
  `trace_summary.summarize`'s ``stats``)."""
  from suites import profile  # pylint: disable=g-import-not-at-top
  per_gpu: list[dict] = []
  try:
    # The whole last step on the first GPU: which of the step's kernels the
    # compute stream's gaps fall between (the report keeps only the totals).
    text = profile.trace(one, state, FLAGS.profile_steps,
                         timeline_events=2000, stats=per_gpu)
    path = os.path.join(FLAGS.out_dir or tempfile.gettempdir(),
                        f"step_profile_{name}.txt")
    results.write_text(path, f"# {name}: {FLAGS.profile_steps} steps\n{text}\n")
    # Named relative to the results it sits beside, when there are any.
    shown = os.path.basename(path) if FLAGS.out_dir else path
    mean = {k: sum(g[k] for g in per_gpu) / len(per_gpu)
            for k in (per_gpu[0] if per_gpu else {}) if k != "gpu"}
    return shown, profile_summary(text), mean
  except Exception as e:  # pylint: disable=broad-except
    return f"failed: {results.short_error(e, 500)}", "", {}


def _memory_report(dump: str, name: str) -> str:
  """Copies XLA's memory-usage report of the largest program it dumped
  (the step) next to the results; returns its name, or why there is none."""
  best, most = None, -1
  for path in glob.glob(os.path.join(dump, "*memory-usage-report.txt")):
    with open(path) as f:
      head = f.read(4096)
    m = re.search(r"Total bytes: (\d+)", head)
    if m and int(m.group(1)) > most:
      best, most = path, int(m.group(1))
  if best is None:
    return "none: XLA dumped no memory-usage report"
  out = os.path.join(FLAGS.out_dir or tempfile.gettempdir(),
                     f"step_memory_{name}.txt")
  with open(best) as f:
    text = f.read()
  results.write_text(out, f"# {name}: {os.path.basename(best)}\n{text}")
  return os.path.basename(out) if FLAGS.out_dir else out


def _in_subprocess(name: str) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:],
           f"--step_variant={name}", f"--step_result_file={path}"]
    env = dict(os.environ)
    if CPU_DEVICES.split("=")[0] not in env.get("XLA_FLAGS", ""):
      # The CPU platform gets 8 virtual devices (a 2 x 4 mesh); this only
      # sizes the CPU platform, so GPU hosts are unaffected.
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CPU_DEVICES).strip()
    dump = os.path.join(tmp, "xla_dump")
    if FLAGS.memory_report:
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}"
    t0 = time.perf_counter()
    try:
      # The interleaved process builds and times every variant.
      limit = FLAGS.variant_timeout_s * (
          len(FLAGS.variants) if name == INTERLEAVED else 1)
      proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                            timeout=limit)
    except subprocess.TimeoutExpired as e:
      return {"variant": name, "error": f"timed out after {e.timeout} s",
              "log_tail": str(e.stderr or "")[-3000:]}
    if proc.returncode != 0 or not os.path.exists(path):
      return {"variant": name, "error": f"exit {proc.returncode}",
              "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    with open(path) as f:
      res = json.load(f)
    if FLAGS.memory_report:
      res["memory_report"] = _memory_report(dump, name)
    res["process_s"] = time.perf_counter() - t0
    return res


def run() -> int:
  if FLAGS.step_mode == "forward" and (FLAGS.remat
                                       or "ficco_tuned" in FLAGS.variants):
    raise ValueError("--remat and the ficco_tuned variant are about the"
                     " training step; run them with --step_mode=train.")
  if FLAGS.memory_report and not FLAGS.step_subprocess:
    raise ValueError("--memory_report dumps each variant's programs from its"
                     " own subprocess; drop --nostep_subprocess.")
  for name in FLAGS.variants:
    if name not in VARIANTS:
      raise ValueError(f"Unknown step variant {name!r}"
                       f" ({', '.join(VARIANTS)}).")
  if FLAGS.step_interleave and ("ficco_tuned" in FLAGS.variants
                                or FLAGS.memory_report):
    # autotune_model clears JAX's caches and writes the autotune cache
    # mid-run, and one dump would hold every variant's programs.
    raise ValueError("--step_interleave times the variants side by side in"
                     " one process: without ficco_tuned and --memory_report.")
  if FLAGS.step_variant:  # A subprocess: its variants, its JSON, nothing else.
    try:
      if FLAGS.step_variant == INTERLEAVED:
        res = {"variants": run_interleaved(list(FLAGS.variants))}
      else:
        res = run_variant(FLAGS.step_variant)
    except Exception:  # pylint: disable=broad-except
      res = {"variant": FLAGS.step_variant,
             "error": traceback.format_exc()[-3000:]}
    results.write_json(FLAGS.step_result_file, res)
    return 0
  variants = {}
  if FLAGS.step_interleave:
    print(f"== step variants {', '.join(FLAGS.variants)}, interleaved",
          flush=True)
    if FLAGS.step_subprocess:
      res = _in_subprocess(INTERLEAVED)
      variants = res.get("variants") or {
          n: {**res, "variant": n} for n in FLAGS.variants}
    else:
      variants = run_interleaved(list(FLAGS.variants))
  for name in FLAGS.variants:
    if not FLAGS.step_interleave:
      print(f"== step variant {name}", flush=True)
      if FLAGS.step_subprocess:
        variants[name] = _in_subprocess(name)
      else:
        try:
          variants[name] = run_variant(name)
        except Exception:  # pylint: disable=broad-except
          variants[name] = {"variant": name,
                            "error": traceback.format_exc()[-3000:]}
    r = variants[name]
    print({k: r.get(k) for k in ("median_ms", "min_ms", "compile_s",
                                 "peak_bytes_max_over_devices", "error",
                                 "warmup_losses")}, flush=True)
    if "error" in r:
      print(r.get("log_tail", r["error"]), flush=True)
  # Only now does this process start JAX: the variants had the GPUs alone.
  meta = meta_lib.collect("step")
  ok = {n: r for n, r in variants.items() if "error" not in r}
  some = next(iter(ok.values()), {})
  data = {"meta": meta, "sizes": sizes(), "attention": FLAGS.attention,
          "schedule": FLAGS.schedules[0], "variants": variants,
          "memory_mode": (
              "one process, the variants timed round-robin; peaks are"
              " cumulative" if FLAGS.step_interleave
              else "fresh subprocess per variant" if FLAGS.step_subprocess
              else "one process; peaks are cumulative")}
  rtol = 1e-4 if sizes()["dtype"] == "float32" else 2e-2
  if "xla" in ok:
    b = ok["xla"]["warmup_losses"][0]
    same = lambda n: abs(ok[n]["warmup_losses"][0] - b) <= rtol * abs(b)  # noqa: E731
    # XLA at its best: the faster XLA variant that computes the same step.
    xlas = [n for n in ("xla", "xla_overlap") if n in ok and same(n)]
    best = min(xlas, key=lambda n: ok[n]["median_ms"])
    data["xla_best"] = best
    data["loss_rtol"] = rtol
    ficcos = [n for n in ("ficco", "ficco_tuned") if n in ok]
    if ficcos:
      data["losses_match"] = all(same(n) for n in ficcos)
    ref = ok["xla"].get("grad_fingerprint")
    if ref:
      # The backward pass too: the loss is the forward pass's alone.
      why = {n: grads_match(ok[n].get("grad_fingerprint") or {}, ref, rtol)
             for n in ficcos}
      data["grads_match"] = all(v is None for v in why.values())
      data["grads_mismatch"] = {n: v for n, v in why.items() if v}
    for n, key in (("ficco", "speedup"), ("ficco_tuned", "speedup_tuned")):
      if n in ok:
        data[key] = ok[best]["median_ms"] / ok[n]["median_ms"]
    if "xla_overlap" in ok and not same("xla_overlap"):
      data["xla_overlap_wrong"] = True
  w = some.get("tp") or meta["device_count"]
  rec = results.Recorder("step", results.out_dir(meta["device_kind"], w),
                         data, markdown)
  rec.finish()
  return 0 if len(ok) == len(variants) and data.get(
      "losses_match", True) and data.get("grads_match", True) else 1


def _gib(b) -> str:
  return "n/a" if b is None else f"{b / 2**30:.2f}"


def _bound_lines(data: dict) -> list[str]:
  """What overlap could win at most, from the profiles: XLA's best step's
  collectives on its compute stream plus that stream's idle time (ms per
  traced step; the idle time may have other causes, so this bounds the
  gain from above), and the part of it ficco's traced step won. Both come
  from the traces, whose steps may run at other clocks than the timed ones
  (see the GPUs while timed)."""
  v = data["variants"]
  best = v.get(data.get("xla_best", ""), {})
  lines = []
  for n in ("ficco", "ficco_tuned"):
    f = v.get(n, {})
    xs, fs = best.get("profile_stats"), f.get("profile_stats")
    if not xs or not fs or "error" in f:
      continue
    bound = xs["exposed"] + xs["idle"]
    gain = xs["window"] - fs["window"]
    share = (f" ({100 * gain / bound:.0f}% of it)" if bound > 0 else "")
    lines += ["", f"Bound ({n}): {data['xla_best']}'s traced step runs"
              f" {xs['exposed']:.2f} ms of collectives on its compute stream"
              f" and leaves that stream idle {xs['idle']:.2f} ms more (mean"
              f" over GPUs, per step): {bound:.2f} ms that overlap could"
              f" hide at most. {n}'s traced step is {gain:.2f} ms shorter"
              f"{share}; its own compute stream runs {fs['exposed']:.2f} ms"
              f" of collectives and idles {fs['idle']:.2f} ms."]
  return lines


def markdown(data: dict) -> str:
  what = {"train": "training step", "forward": "prefill (forward)"}[
      data["sizes"].get("mode", "train")]
  lines = [f"# Tensor-parallel transformer {what}: ficco vs XLA collectives",
           ""]
  lines += report.provenance(data["meta"])
  lines += [f"- sizes: {data['sizes']}, attention={data['attention']},"
            f" {data['memory_mode']}", ""]
  rows = []
  for name, r in data["variants"].items():
    if "error" in r:
      rows.append([name, f"error: {r['error'][:200]}", "", "", "", "", "",
                   "", "", "", "", ""])
      continue
    ma = r.get("memory_analysis")
    temp = ma.get("temp_size_in_bytes") if isinstance(ma, dict) else None
    mfu = r.get("mfu")
    rows.append([name, f"`{r['schedule']}`", f"{r.get('dp')}x{r.get('tp')}",
                 f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}",
                 f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "",
                 (f"{r['model_tflops_per_device']:.3g}"
                  if "model_tflops_per_device" in r else ""),
                 f"{100 * mfu:.1f}%" if mfu else "n/a",
                 f"{r['compile_s']:.1f}",
                 _gib(r.get("peak_bytes_max_over_devices")), _gib(temp),
                 f"{r['warmup_losses'][0]:.6f}"])
  lines += report.table(["variant", "schedule", "dp x tp", "median ms",
                         "min ms", "tokens/s", "model TFLOP/s/device", "MFU",
                         "compile s", "peak GiB/device (max)",
                         "temp GiB (compiled)", "first loss"], rows)
  clocks = [f"{n}: {gpu_monitor.describe(r['gpus_while_timed'])}"
            for n, r in data["variants"].items()
            if r.get("gpus_while_timed")]
  if clocks:
    lines += ["", "GPUs while timed (nvidia-smi every 200 ms; SM clock and"
              " power, mean per GPU, the range over GPUs):", ""]
    lines += [f"- {c}" for c in clocks]
  if "speedup" in data:
    best = data.get("xla_best", "xla")
    lines += ["", f"Speedup ({best} / ficco): {data['speedup']:.3f}x; first"
              f" losses match (rtol {data['loss_rtol']:g}):"
              f" {data['losses_match']}"
              + ("" if "grads_match" not in data else
                 f"; step 0's gradients match XLA's (norm and"
                 f" {GRAD_PROJECTIONS} random projections per parameter):"
                 f" {data['grads_match']}"
                 + "".join(f" ({n}: {v})" for n, v in
                           data.get("grads_mismatch", {}).items()))]
  if data.get("xla_overlap_wrong"):
    lines += ["", "xla_overlap's first loss differs from xla's: not a"
              " baseline."]
  resolved = data["variants"].get("ficco", {}).get("resolved")
  if resolved:
    lines.append(f"\nschedule=None resolves to: {resolved}")
  tuned = data["variants"].get("ficco_tuned", {})
  if "autotune_model" in tuned:
    a = tuned["autotune_model"]
    gain = (f"speedup over {data['xla_best']} {data['speedup_tuned']:.3f}x"
            if "speedup_tuned" in data else "no XLA variant to compare with")
    lines += ["", f"ficco_tuned (peak memory includes the tuning's):"
              f" autotune_model took {a['seconds']:.0f} s; {gain};"
              f" then schedule=None resolves to: {tuned.get('resolved')}", "",
              "```", a["report"], "```"]
  reports = [f"{n}: {r['memory_report']}" for n, r in
             data["variants"].items() if r.get("memory_report")]
  if reports:
    lines += ["", "XLA's memory-usage reports (`--memory_report`: the"
              " buffers live at each step program's peak): "
              + ", ".join(reports)]
  lines += _bound_lines(data)
  profiled = {n: r for n, r in data["variants"].items()
              if r.get("profile_summary")}
  if profiled:
    lines += ["", "Profile (`--profile_steps`): per GPU and step, each"
              " stream's busy time, the collectives run on the compute"
              " stream (exposed) and beside it, and the compute stream's"
              " idle time: with the step time outside the traced window"
              " (host launch), where a step's time goes."]
    for n, r in profiled.items():
      lines += ["", f"{n} (whole summary: {r['profile']}):", "", "```",
                r["profile_summary"], "```"]
  return "\n".join(lines) + "\n"
