"""Times a training step of a tensor-parallel transformer block, ficco vs XLA.

The block is examples/tp_transformer.py (Megatron sequence parallelism on a
``dp x tp`` mesh, pjit style). One training step is forward + backward + Adam
update, jitted with the parameters and optimizer state donated. Two variants:

  ficco  the four tensor-parallel matmuls through ficco_jax.sharded
         (``--schedule``, default: the library's heuristic);
  xla    plain ``x @ w`` with the same sharding constraints, so XLA inserts
         the all-gathers and reduce-scatters (and overlaps what it can).

Timing (benchmarks/timing.py's method, with the training state threaded
through the calls instead of rotated): ``--warmup`` calls (the first compiles),
then ``--rounds`` rounds of ``--iters`` back-to-back steps with one block at
the end of each round; per-step time = round time / iters; we report the
median and min over rounds.

Peak memory: each variant runs in a fresh subprocess of this script, so each
device's ``memory_stats()['peak_bytes_in_use']`` is that variant's own peak
(parameters, optimizer state, compile-time scratch and the steps), not the
max of both. ``--nosubprocess`` runs both in this process instead; then the
peak is cumulative and the second variant's number is max(first, second);
the JSON says which mode was used (``memory_mode``). The compiled step's own
``memory_analysis()`` (temp / argument / output bytes per device) is recorded
too, and is what CPU runs (which have no allocator stats) can compare.

Each variant also records its first warm-up step's loss (same seed, same
data), and the report says whether the two agree.

  # The 4-GPU host (dp=1, tp=4), Llama-70B-sized block, bf16:
  python benchmarks/tp_block_bench.py
  python benchmarks/tp_block_bench.py --schedule=direct:2:dma --attention=cudnn
  # CPU smoke test (8 virtual devices, 2x4):
  PYTHONPATH=. python benchmarks/tp_block_bench.py --tiny
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# Before jax starts: NVLink multicast must stay off on the shared GPU hosts
# (benchmarks/run_gpu.sh says why); the CPU platform gets 8 virtual devices
# for --tiny (harmless on GPU hosts).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.append(os.path.join(HERE, ".."))  # After the installed package.
sys.path.insert(0, HERE)  # profile_summary.py

FLAGS = flags.FLAGS
flags.DEFINE_integer("d_model", 8192, "Model width.")
flags.DEFINE_integer("heads", 64, "Attention heads (divisible by tp).")
flags.DEFINE_integer("d_ff", 28672, "MLP width (divisible by tp).")
flags.DEFINE_integer("seq", 8192, "Sequence length.")
flags.DEFINE_integer("batch", 1, "Global batch (divisible by dp).")
flags.DEFINE_string("dtype", "bfloat16", "Compute dtype (parameters: float32).")
flags.DEFINE_enum("attention", "xla", ["xla", "cudnn"],
                  "Attention kernel: the example's einsum softmax, or cuDNN's"
                  " fused one (GPU, bf16). The same in both variants.")
flags.DEFINE_string("schedule", "default",
                    "ficco schedule: 'default' (heuristic), 'none', or"
                    " 'dataflow:chunks[:comm[:compute]]', e.g. direct:2:dma.")
flags.DEFINE_integer("dp", None, "Data-parallel size (default 1 on GPU).")
flags.DEFINE_integer("tp", None, "Tensor-parallel size (default: all GPUs).")
flags.DEFINE_list("variants", ["ficco", "xla"], "Variants to time.")
flags.DEFINE_integer("warmup", 3, "Warm-up steps (the first compiles).")
flags.DEFINE_integer("rounds", 5, "Timed rounds.")
flags.DEFINE_integer("iters", 10, "Back-to-back steps per round.")
flags.DEFINE_float("lr", 1e-4, "Adam learning rate.")
flags.DEFINE_bool("tiny", False, "CPU smoke sizes: d_model 64, heads 8, d_ff"
                  " 256, seq 64, batch 2*dp, float32, 1 round of 2 steps.")
flags.DEFINE_bool("subprocess", True, "Run each variant in a fresh process"
                  " (clean peak memory); see the module docstring.")
flags.DEFINE_integer("variant_timeout_s", 250, "Time limit of one variant's"
                     " subprocess.")
flags.DEFINE_string("out_dir", os.path.join(HERE, "results"), "Where results go.")
flags.DEFINE_string("tag", None, "Result file tag (default: platform_dpXtpY).")
flags.DEFINE_integer("profile_steps", 0,
                     "After timing, trace this many steps with the JAX"
                     " profiler and write profile_summary.py's report to"
                     " <out_dir>/tp_profile_<variant>.txt.")
# Internal: set on the subprocesses.
flags.DEFINE_string("variant", None, "Run only this variant (internal).")
flags.DEFINE_string("result_file", None, "Where --variant writes (internal).")


def _sizes():
  """(dict of model/run sizes) after --tiny."""
  s = dict(d_model=FLAGS.d_model, heads=FLAGS.heads, d_ff=FLAGS.d_ff,
           seq=FLAGS.seq, batch=FLAGS.batch, dtype=FLAGS.dtype,
           warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)
  if FLAGS.tiny:
    s.update(d_model=64, heads=8, d_ff=256, seq=64, batch=None,
             dtype="float32", warmup=2, rounds=1, iters=2)
  return s


def _memory(devices):
  out = []
  for d in devices:
    stats = d.memory_stats() or {}
    out.append({k: stats.get(k) for k in
                ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")})
  return out


def _default_schedules(cfg, dp, tp, batch, seq):
  """What schedule=None resolves to for the block's forward matmuls."""
  import ficco_jax  # pylint: disable=g-import-not-at-top
  b, s, d, f = batch // dp, seq, cfg.d_model, cfg.d_ff
  out = {}
  for name, n in (("qkv", 3 * d), ("up", f)):
    out[name] = ficco_jax.choose_schedule(
        "all_gather_matmul", x_shape=(b, s // tp, d), w_shape=(d, n // tp),
        dtype=cfg.dtype, axis_size=tp, axis=1).short()
  for name, k in (("out", d), ("down", f)):
    out[name] = ficco_jax.choose_schedule(
        "matmul_reduce_scatter", x_shape=(b, s, k // tp), w_shape=(k // tp, d),
        dtype=cfg.dtype, axis_size=tp, axis=1).short()
  return out


def run_variant(name: str) -> dict:
  """Builds, compiles and times one variant in this process."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import tp_transformer as tpt

  sz = _sizes()
  dp, tp = FLAGS.dp, FLAGS.tp
  if jax.default_backend() != "cpu" and dp is None:
    dp = 1
  dp, tp = tpt.default_mesh_shape(dp, tp)
  mesh = tpt.make_mesh(dp, tp)
  batch = sz["batch"] or 2 * dp
  cfg = tpt.Config(d_model=sz["d_model"], heads=sz["heads"], d_ff=sz["d_ff"],
                   dtype=jnp.dtype(sz["dtype"]), attention=FLAGS.attention)
  schedule = tpt.parse_schedule(FLAGS.schedule)
  devices = list(mesh.devices.flat)
  res = {"variant": name, "dp": dp, "tp": tp, "batch": batch,
         "schedule": ("XLA collectives" if name == "xla" else
                      schedule.short() if schedule else "default"),
         "memory_before": _memory(devices)}
  if name == "ficco" and schedule is None:
    res["default_resolves_to"] = _default_schedules(cfg, dp, tp, batch,
                                                     sz["seq"])

  params = tpt.init_params(jax.random.key(0), cfg, mesh)
  opt = tpt.adam_init(params)
  batches = [tpt.make_batch(jax.random.key(100 + i), cfg, mesh, batch,
                            sz["seq"]) for i in range(2)]
  step = tpt.make_train_step(cfg, mesh, use_ficco=(name == "ficco"),
                             schedule=schedule, lr=FLAGS.lr, donate=True)
  t0 = time.perf_counter()
  compiled = step.lower(params, opt, *batches[0]).compile()
  res["compile_s"] = time.perf_counter() - t0
  try:
    ma = compiled.memory_analysis()
    res["memory_analysis"] = {
        k: getattr(ma, k, None) for k in
        ("temp_size_in_bytes", "argument_size_in_bytes",
         "output_size_in_bytes", "alias_size_in_bytes",
         "generated_code_size_in_bytes")}
  except Exception as e:  # pylint: disable=broad-except
    res["memory_analysis"] = f"unavailable: {e}"

  # Warm-up, keeping the losses: the first is step 0 from the same seed and
  # data in both variants.
  losses, k = [], 0
  for _ in range(max(1, sz["warmup"])):
    params, opt, loss = compiled(params, opt, *batches[k % 2])
    k += 1
    losses.append(float(loss))
  res["warmup_losses"] = losses

  per_step = []
  for _ in range(sz["rounds"]):
    t0 = time.perf_counter()
    for _ in range(sz["iters"]):
      params, opt, loss = compiled(params, opt, *batches[k % 2])
      k += 1
    # Each device runs its steps in order, so the last step's outputs being
    # ready means every step of the round is done.
    jax.block_until_ready((params, opt, loss))
    per_step.append((time.perf_counter() - t0) * 1e3 / sz["iters"])
  res.update(median_ms=statistics.median(per_step), min_ms=min(per_step),
             rounds_ms=per_step, rounds=sz["rounds"], iters=sz["iters"],
             final_loss=float(loss))
  res["memory_after"] = _memory(devices)
  if FLAGS.profile_steps:
    res["profile"] = _profile(compiled, params, opt, batches, name)
  peaks = [m["peak_bytes_in_use"] for m in res["memory_after"]]
  res["peak_bytes_max_over_devices"] = (max(peaks) if all(
      p is not None for p in peaks) else None)
  return res


def _profile(compiled, params, opt, batches, name: str) -> str:
  """Traces a few steps; returns the report's path (or why it failed)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import profile_summary  # pylint: disable=g-import-not-at-top

  tmp = tempfile.mkdtemp(prefix="ficco_tp_prof_")
  try:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    try:
      for i in range(FLAGS.profile_steps):
        params, opt, loss = compiled(params, opt, *batches[i % 2])
      jax.block_until_ready((params, opt, loss))
    finally:
      jax.profiler.stop_trace()
    text = profile_summary.summarize(profile_summary.load(tmp),
                                     calls=FLAGS.profile_steps,
                                     timeline_events=0)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    path = os.path.join(FLAGS.out_dir, f"tp_profile_{name}.txt")
    with open(path, "w") as f:
      f.write(f"# {name}: {FLAGS.profile_steps} steps\n{text}\n")
    return path
  except Exception as e:  # pylint: disable=broad-except
    return f"failed: {type(e).__name__}: {str(e)[:500]}"
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _run_in_subprocess(name: str) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:],
           f"--variant={name}", f"--result_file={path}"]
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True,
                            timeout=FLAGS.variant_timeout_s)
    except subprocess.TimeoutExpired as e:
      return {"variant": name, "error": f"timed out after {e.timeout} s",
              "log_tail": str(e.stderr or "")[-3000:]}
    if proc.returncode != 0 or not os.path.exists(path):
      return {"variant": name, "error": f"exit {proc.returncode}",
              "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    with open(path) as f:
      res = json.load(f)
    res["process_s"] = time.perf_counter() - t0
    return res


def _gib(b):
  return "n/a" if b is None else f"{b / 2**30:.2f}"


def _markdown(report: dict) -> str:
  lines = ["# TP transformer block training step: ficco vs XLA collectives",
           "", f"- command: `{report['command']}`",
           f"- device: {report['device_kind']} x {report['num_devices']},"
           f" jax {report['jax_version']}, {report['memory_mode']}",
           f"- sizes: {report['sizes']}, attention={report['attention']}",
           "", "| variant | schedule | median ms | min ms | compile s |"
           " peak GiB/device (max) | temp GiB (compiled) | first loss |",
           "|---|---|---|---|---|---|---|---|"]
  for name, r in report["variants"].items():
    if "error" in r:
      lines.append(f"| {name} | error: {r['error']} | | | | | | |")
      continue
    ma = r.get("memory_analysis")
    temp = ma.get("temp_size_in_bytes") if isinstance(ma, dict) else None
    lines.append(
        f"| {name} | {r['schedule']} | {r['median_ms']:.2f} |"
        f" {r['min_ms']:.2f} | {r['compile_s']:.1f} |"
        f" {_gib(r['peak_bytes_max_over_devices'])} | {_gib(temp)} |"
        f" {r['warmup_losses'][0]:.6f} |")
  for key in ("speedup", "losses_match", "default_resolves_to"):
    if key in report:
      lines.append(f"\n{key}: {report[key]}")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if FLAGS.variant:  # A subprocess: one variant, its JSON, nothing else.
    try:
      res = run_variant(FLAGS.variant)
    except Exception:  # pylint: disable=broad-except
      res = {"variant": FLAGS.variant, "error": traceback.format_exc()[-3000:]}
    with open(FLAGS.result_file, "w") as f:
      json.dump(res, f, indent=1)
    print(json.dumps(res)[:2000])
    return

  import jax  # pylint: disable=g-import-not-at-top
  variants = {}
  for name in FLAGS.variants:
    if name not in ("ficco", "xla"):
      raise app.UsageError(f"Unknown variant {name!r}.")
    print(f"== {name}", flush=True)
    if FLAGS.subprocess:
      variants[name] = _run_in_subprocess(name)
    else:
      try:
        variants[name] = run_variant(name)
      except Exception:  # pylint: disable=broad-except
        variants[name] = {"variant": name, "error": traceback.format_exc()[-3000:]}
    r = variants[name]
    print({k: r.get(k) for k in ("median_ms", "min_ms", "compile_s",
                                 "peak_bytes_max_over_devices", "error",
                                 "warmup_losses")}, flush=True)
    if "error" in r:
      print(r.get("log_tail", r["error"]), flush=True)

  dev = jax.devices()[0]
  report = {
      "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
      "device_kind": dev.device_kind, "platform": dev.platform,
      "num_devices": jax.device_count(), "jax_version": jax.__version__,
      "host": socket.gethostname(), "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
      "memory_mode": ("fresh subprocess per variant" if FLAGS.subprocess else
                      "one process; peaks are cumulative"),
      "sizes": _sizes(), "attention": FLAGS.attention,
      "schedule": FLAGS.schedule, "variants": variants,
  }
  ok = {n: r for n, r in variants.items() if "error" not in r}
  if "ficco" in ok and "xla" in ok:
    report["speedup"] = round(ok["xla"]["median_ms"] / ok["ficco"]["median_ms"], 4)
    a, b = ok["ficco"]["warmup_losses"][0], ok["xla"]["warmup_losses"][0]
    rtol = 1e-4 if _sizes()["dtype"] == "float32" else 2e-2
    report["losses_match"] = bool(abs(a - b) <= rtol * abs(b))
    if "default_resolves_to" in ok["ficco"]:
      report["default_resolves_to"] = ok["ficco"]["default_resolves_to"]

  os.makedirs(FLAGS.out_dir, exist_ok=True)
  some = next(iter(ok.values()), {})
  tag = FLAGS.tag or (f"{dev.platform}_dp{some.get('dp', '?')}"
                      f"tp{some.get('tp', '?')}" + ("_tiny" if FLAGS.tiny else ""))
  base = os.path.join(FLAGS.out_dir, f"tp_block_{tag}")
  with open(base + ".json", "w") as f:
    json.dump(report, f, indent=1)
  md = _markdown(report)
  with open(base + ".md", "w") as f:
    f.write(md)
  print(md)
  print(f"wrote {base}.json and {base}.md")
  if len(ok) != len(variants) or report.get("losses_match") is False:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
