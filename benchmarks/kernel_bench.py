"""One-GPU benchmark of the Pallas chunk matmul that writes in place.

For chunk shapes of the tensor-parallel matmuls (per device, axis size W):
  all-gather side   x [mc, H]   @ w [H, F/W]  (K = H,   n = F/W)
  reduce-scatter    h [mc, F/W] @ w [F/W, H]  (K = F/W, n = H)
with chunk rows mc in --mcs, it times
  xla_dot      XLA dot into a fresh [mc, n] (cuBLAS: the throughput reference)
  xla_dot_dus  XLA dot, then dynamic_update_slice into the big output
  pallas       chunk_matmul_into (Hopper kernel, default config, all SMs)
  pallas/smN   the same with num_sms=N
  pallas/cfg…  the tile-config sweep (--tune; all-gather shapes only)
The big output has W * mc rows; one jitted call writes all W chunks (W
kernels, offsets c * mc as traced int32s) and the output is donated, so every
call updates it in place as the overlapped dataflows do. Times are per chunk
(call time / W); W kernels per call also amortize the Python dispatch.

Timing (the method of benchmarks/timing.py): compile + 3 warm-up calls, then
--rounds rounds of --iters back-to-back calls with one block at the end of each
round; per-call time = round time / iters; median (and min) over rounds.
Inputs are random normal (never zeros) and rotate between two sets of W x
chunks.

Before timing, each shape is checked once on the GPU: out poisoned with NaN,
relative error vs an f32 XLA reference on the same inputs, untouched rows
still NaN. Results go to --out_dir/kernel_bench_<device>.{json,md}.

Run: PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/kernel_bench.py
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback

from absl import app
from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Per-device model dims (from shapes.json; copied so the script runs anywhere).
MODELS = {
    "llama3-8b": {"H": 4096, "F": 14336},
    "llama3-70b": {"H": 8192, "F": 28672},
    "llama3-405b": {"H": 16384, "F": 53248},
    "qwen2-72b": {"H": 8192, "F": 29568},
    "gpt3-175b": {"H": 12288, "F": 49152},
}

FLAGS = flags.FLAGS
flags.DEFINE_string("shapes", None,
                    "Optional shapes.json to read model dims from (default:"
                    " the copy in this script).")
flags.DEFINE_list("models", ["llama3-70b", "llama3-8b", "llama3-405b",
                             "gpt3-175b", "qwen2-72b"], "Models to run.")
flags.DEFINE_list("full_models", ["llama3-70b"],
                  "Models that also get the correctness checks, the num_sms"
                  " sweep and the tile sweep (others: xla + default pallas).")
flags.DEFINE_integer("axis_size", 4, "W: tensor-parallel axis size.")
flags.DEFINE_list("mcs", ["512", "1024", "2048", "4096"], "Chunk rows mc.")
flags.DEFINE_list("ops", ["ag", "rs"], "ag: [mc,H]@[H,F/W]; rs: [mc,F/W]@[F/W,H].")
flags.DEFINE_list("num_sms", ["132", "112", "96"], "num_sms values to time.")
flags.DEFINE_bool("tune", True, "Sweep tile configs on full_models' shapes.")
flags.DEFINE_enum("tune_set", "tiles", ["tiles", "depth"],
                  "--tune's configs: CTA tile shapes (tiles), or step depth"
                  " and pipeline stages at the default tile (depth).")
flags.DEFINE_bool("check", True, "Check correctness before timing.")
flags.DEFINE_integer("warmup", 3, "Warm-up calls (the first compiles).")
flags.DEFINE_integer("rounds", 5, "Timed rounds.")
flags.DEFINE_integer("iters", 20, "Back-to-back calls per round.")
flags.DEFINE_string("out_dir", os.path.join(HERE, "results"), "Output folder.")
flags.DEFINE_string("tag", None, "File tag (default: the device name).")
flags.DEFINE_float("time_budget_s", 480.0,
                   "Stop starting new shapes after this many seconds.")


def _load_chunk_matmul():
  """Imports ficco_jax._src.pallas.chunk_matmul without ficco_jax/__init__.

  The module depends on nothing else in ficco_jax, so loading it by path keeps
  this script independent of the state of the rest of the package.
  """
  try:
    from ficco_jax._src.pallas import chunk_matmul  # pylint: disable=g-import-not-at-top
    return chunk_matmul
  except Exception:  # pylint: disable=broad-except
    path = os.path.join(ROOT, "ficco_jax", "_src", "pallas", "chunk_matmul.py")
    spec = importlib.util.spec_from_file_location("ficco_chunk_matmul", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _time_chain(step, out, arg_sets, *, warmup, rounds, iters):
  """Times ``out = step(out, *args)`` calls; ``out`` is donated each call."""
  import jax  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  out = step(out, *arg_sets[0])
  jax.block_until_ready(out)
  first_s = time.perf_counter() - t0
  k = 1
  for _ in range(max(0, warmup - 1)):
    out = step(out, *arg_sets[k % len(arg_sets)])
    k += 1
  jax.block_until_ready(out)
  per_call = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = step(out, *arg_sets[k % len(arg_sets)])
      k += 1
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - t0) * 1e3 / iters)
  return out, {
      "median_ms": statistics.median(per_call),
      "min_ms": min(per_call),
      "rounds_ms": per_call,
      "iters": iters,
      "compile_and_first_call_s": first_s,
  }


def _configs(cm):
  c = cm.ChunkMatmulConfig
  if FLAGS.tune_set == "depth":
    # Pipeline depth at the default 128x256 tile: full-depth (64) steps, and
    # half-depth (32; 64-byte swizzle, what a K not a multiple of 64 needs)
    # with as many stages as fit, to see what the half depth costs.
    return {
        f"128x256/k{tk}/s{st}": c(tile_m=64, tile_n=256, wg_dimension="m",
                                  tile_k=tk, max_concurrent_steps=st)
        for tk, st in ((64, 4), (32, 4), (32, 6), (32, 7))
    }
  return {
      "128x256/wgM(64x256)": c(tile_m=64, tile_n=256, wg_dimension="m"),
      "128x256/wgM(64x256)/w8": c(tile_m=64, tile_n=256, wg_dimension="m",
                                  grid_tile_width=8),
      "128x256/wgM(64x256)/minorM": c(tile_m=64, tile_n=256, wg_dimension="m",
                                      grid_minor_dim="m"),
      "128x256/wgN(128x128)": c(tile_m=128, tile_n=128, wg_dimension="n"),
      "256x128/wgM(128x128)": c(tile_m=128, tile_n=128, wg_dimension="m"),
      "128x192/wgM(64x192)": c(tile_m=64, tile_n=192, wg_dimension="m"),
      "128x128/wgM(64x128)": c(tile_m=64, tile_n=128, wg_dimension="m"),
  }


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top

  cm = _load_chunk_matmul()
  start = time.time()
  models = dict(MODELS)
  if FLAGS.shapes:
    with open(FLAGS.shapes) as f:
      models.update(json.load(f)["models"])
  dev = jax.devices()[0]
  device_name = getattr(dev, "device_kind", str(dev))
  tag = FLAGS.tag or device_name.lower().replace(" ", "_")
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  json_path = os.path.join(FLAGS.out_dir, f"kernel_bench_{tag}.json")
  md_path = os.path.join(FLAGS.out_dir, f"kernel_bench_{tag}.md")
  report = {
      "device": device_name,
      "num_sms_device": getattr(dev, "core_count", None),
      "jax": jax.__version__,
      "jaxlib": _jaxlib_version(),
      "python": platform.python_version(),
      "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "method": ("median over rounds of (round time / iters) for iters"
                 " back-to-back jitted calls, one block per round, after"
                 " warm-up; output donated (in place)"),
      "checks": [],
      "results": [],
  }
  W = FLAGS.axis_size
  key = jax.random.key(0)

  def save():
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1)
    _write_md(report, md_path)

  def dot_f32acc(x, w, dtype):
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)

  shapes = []
  for model in FLAGS.models:
    h, f_ = models[model]["H"], models[model]["F"]
    for op in FLAGS.ops:
      k, n = (h, f_ // W) if op == "ag" else (f_ // W, h)
      for mc in map(int, FLAGS.mcs):
        shapes.append((model, op, mc, k, n))

  # ------------------------------------------------------------ correctness
  if FLAGS.check:
    for model, op, mc, k, n in shapes:
      full = model in FLAGS.full_models
      if not full and mc != int(FLAGS.mcs[0]):
        continue  # Other models: the default config at the first mc only.
      key, k1, k2 = jax.random.split(key, 3)
      x = jax.random.normal(k1, (mc, k), jnp.bfloat16)
      w = jax.random.normal(k2, (k, n), jnp.bfloat16)
      ref = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                                         precision=lax.Precision.HIGHEST))(x, w)
      variants = [("static", mc, {})]
      if full:
        variants += [("traced", 2 * mc, {}), ("sm7", (W - 1) * mc, {"num_sms": 7})]
      if full and FLAGS.tune and mc == int(FLAGS.mcs[0]):
        for name, cfg in _configs(cm).items():
          try:
            cfg.check_shapes(mc, n, k)
          except ValueError:
            continue  # This tile does not divide the shape; not run either.
          variants.append((f"cfg:{name}", mc, {"config": cfg}))
      for name, off, kw in variants:
        rec = {"model": model, "op": op, "mc": mc, "K": k, "n": n,
               "variant": name, "row_offset": off}
        try:
          out = jnp.full((W * mc, n), jnp.nan, jnp.bfloat16)
          if name != "traced":
            fn = jax.jit(lambda o, x, w, off=off, kw=kw: cm.chunk_matmul_into(
                o, x, w, off, **kw))
            res = fn(out, x, w)
          else:
            fn = jax.jit(lambda o, x, w, i: cm.chunk_matmul_into(o, x, w, i))
            res = fn(out, x, w, jnp.int32(off))
          got = res[off:off + mc].astype(jnp.float32)
          rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
          untouched = bool(jnp.isnan(res[:off]).all() & jnp.isnan(res[off + mc:]).all())
          finite = bool(jnp.isfinite(got).all())
          rec.update(rel_err=rel, untouched_rows_nan=untouched, chunk_finite=finite,
                     ok=bool(rel < 1e-2 and untouched and finite))
        except Exception as e:  # pylint: disable=broad-except
          rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        report["checks"].append(rec)
        print("check", rec, flush=True)
      del x, w, ref
    # f16 and a bf16 -> f32 output once.
    for name, in_dt, out_dt in (("f16", jnp.float16, jnp.float16),
                                ("bf16->f32", jnp.bfloat16, jnp.float32)):
      mc, k, n = 512, 2048, 1024
      key, k1, k2 = jax.random.split(key, 3)
      x = jax.random.normal(k1, (mc, k), in_dt)
      w = jax.random.normal(k2, (k, n), in_dt)
      ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
      out = jnp.full((4 * mc, n), jnp.nan, out_dt)
      rec = {"variant": name, "mc": mc, "K": k, "n": n, "row_offset": 2 * mc}
      try:
        res = jax.jit(lambda o, x, w: cm.chunk_matmul_into(o, x, w, 2 * mc))(out, x, w)
        got = res[2 * mc:3 * mc].astype(jnp.float32)
        rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        untouched = bool(jnp.isnan(res[:2 * mc]).all() & jnp.isnan(res[3 * mc:]).all())
        rec.update(rel_err=rel, untouched_rows_nan=untouched,
                   ok=bool(rel < 1e-2 and untouched))
      except Exception as e:  # pylint: disable=broad-except
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
      report["checks"].append(rec)
      print("check", rec, flush=True)
    save()

  # ------------------------------------------------------------ timing
  timing_kw = dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)
  for model, op, mc, k, n in shapes:
    if time.time() - start > FLAGS.time_budget_s:
      print(f"time budget reached; skipping {model} {op} mc={mc}", flush=True)
      report.setdefault("skipped", []).append([model, op, mc, k, n])
      continue
    flops = 2.0 * mc * k * n
    # One call writes all W chunks of the big output (W kernels, as the
    # dataflows do), which amortizes the Python dispatch over W kernels;
    # reported times are per chunk (call time / W). Two sets of W distinct x
    # chunks alternate between calls.
    key, k3, *ks = jax.random.split(key, 2 + 2 * W)
    x_sets = [tuple(jax.random.normal(ks[s * W + c], (mc, k), jnp.bfloat16)
                    for c in range(W)) for s in range(2)]
    w = jax.random.normal(k3, (k, n), jnp.bfloat16)
    offs = jnp.arange(W, dtype=jnp.int32) * mc  # Traced offsets.
    arg_sets = [(xs, w, offs) for xs in x_sets]
    row = {"model": model, "op": op, "mc": mc, "K": k, "n": n, "M_out": W * mc,
           "chunks_per_call": W, "times": {}}

    def run(name, chunk_fn, out0):
      # chunk_fn(out, x_c, w, offset_c) -> out, applied to every chunk.
      def step(out, xs, w, offs):
        for c in range(W):
          out = chunk_fn(out, xs[c], w, offs[c])
        return out
      try:
        out, t = _time_chain(jax.jit(step, donate_argnums=0), out0, arg_sets,
                             **timing_kw)
        del out
        for key_ in ("median_ms", "min_ms"):
          t[key_] /= W
        t["rounds_ms"] = [v / W for v in t["rounds_ms"]]
        t["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
        row["times"][name] = t
        print(f"  {model} {op} mc={mc} K={k} n={n} {name}: "
              f"{t['median_ms'] * 1e3:.1f} us  {t['tflops']:.0f} TFLOP/s", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        row["times"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        traceback.print_exc(limit=2)

    big = lambda: jnp.zeros((W * mc, n), jnp.bfloat16)
    # cuBLAS reference: each chunk's dot alone into a fresh [mc, n]; the
    # carried tuple keeps all W results alive (and donated, so reused).
    def dot_only(out, x, w, off):
      del off
      return out[1:] + (dot_f32acc(x, w, jnp.bfloat16),)
    run("xla_dot", dot_only,
        tuple(jnp.zeros((mc, n), jnp.bfloat16) for _ in range(W)))
    run("xla_dot_dus", lambda o, x, w, i: lax.dynamic_update_slice(
        o, dot_f32acc(x, w, jnp.bfloat16), (i, jnp.int32(0))), big())
    try:
      cfg = cm.default_config(mc, k, n, num_sms=report["num_sms_device"] or 132)
      row["default_config"] = str(cfg)
    except ValueError as e:
      row["default_config"] = f"none: {e}"
    run("pallas", lambda o, x, w, i: cm.chunk_matmul_into(o, x, w, i), big())
    full = model in FLAGS.full_models
    for s in map(int, FLAGS.num_sms if full else FLAGS.num_sms[:1]):
      run(f"pallas/sm{s}", lambda o, x, w, i, s=s: cm.chunk_matmul_into(
          o, x, w, i, num_sms=s), big())
    if FLAGS.tune and full:
      for cname, cfg in _configs(cm).items():
        try:
          cfg.check_shapes(mc, n, k)
        except ValueError:
          continue
        run(f"pallas/cfg:{cname}", lambda o, x, w, i, cfg=cfg: cm.chunk_matmul_into(
            o, x, w, i, config=cfg), big())
    ref_ms = row["times"].get("xla_dot", {}).get("median_ms")
    dus_ms = row["times"].get("xla_dot_dus", {}).get("median_ms")
    for name, t in row["times"].items():
      if ref_ms and "median_ms" in t:
        t["vs_cublas"] = ref_ms / t["median_ms"]
      if dus_ms and "median_ms" in t:
        t["vs_xla_dus"] = dus_ms / t["median_ms"]
    report["results"].append(row)
    save()
    del x_sets, w

  # Last, since a failure here could poison the GPU context: a traced row
  # offset that is not a multiple of 8 (the kernel promises layout inference
  # a multiple of 8; TMA itself takes any row coordinate).
  if FLAGS.check and shapes:
    model, op, mc, k, n = shapes[0]
    key, k1, k2 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (mc, k), jnp.bfloat16)
    w = jax.random.normal(k2, (k, n), jnp.bfloat16)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                  precision=lax.Precision.HIGHEST)
    off = mc + 3
    rec = {"model": model, "op": op, "mc": mc, "K": k, "n": n,
           "variant": "traced offset not a multiple of 8 (informational)",
           "row_offset": off, "informational": True}
    try:
      out = jnp.full((W * mc, n), jnp.nan, jnp.bfloat16)
      res = jax.jit(lambda o, x, w, i: cm.chunk_matmul_into(o, x, w, i))(
          out, x, w, jnp.int32(off))
      got = res[off:off + mc].astype(jnp.float32)
      rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
      untouched = bool(jnp.isnan(res[:off]).all() & jnp.isnan(res[off + mc:]).all())
      rec.update(rel_err=rel, untouched_rows_nan=untouched,
                 ok=bool(rel < 1e-2 and untouched))
    except Exception as e:  # pylint: disable=broad-except
      rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    report["checks"].append(rec)
    print("check", rec, flush=True)

  report["elapsed_s"] = time.time() - start
  save()
  print(open(md_path).read())


def _jaxlib_version():
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    return jaxlib.__version__
  except Exception:  # pylint: disable=broad-except
    return None


def _write_md(report, path):
  lines = [
      f"# Pallas chunk matmul vs XLA on {report['device']}",
      "",
      f"jax {report['jax']}, python {report['python']}, {report['date_utc']}",
      f"command: `{report['command']}`",
      f"method: {report['method']}",
      "",
  ]
  if report["checks"]:
    bad = [c for c in report["checks"]
           if not c.get("ok") and not c.get("informational")]
    info = [c for c in report["checks"] if c.get("informational")]
    n_checks = len(report["checks"]) - len(info)
    lines.append(f"correctness: {n_checks - len(bad)}/{n_checks} checks passed")
    for c in info:
      lines.append(f"- informational: {c}")
    for c in bad:
      lines.append(f"- FAILED: {c}")
    worst = max((c.get("rel_err", 0) for c in report["checks"]), default=0)
    lines.append(f"- worst relative error vs f32 reference: {worst:.2e}")
    lines.append("")
  lines += [
      "vs cuBLAS dot / vs XLA dot+DUS: the method's throughput over theirs"
      " (time ratio ref/method; > 1 is faster).",
      "",
      "| model | op | mc | K | n | method | median us | TFLOP/s | vs cuBLAS dot"
      " | vs XLA dot+DUS |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in report["results"]:
    for name, t in r["times"].items():
      if "median_ms" not in t:
        err = t.get("error", "error").replace("|", "/")[:120]
        lines.append(f"| {r['model']} | {r['op']} | {r['mc']} | {r['K']} | {r['n']}"
                     f" | {name} | {err} | | | |")
        continue
      lines.append(
          f"| {r['model']} | {r['op']} | {r['mc']} | {r['K']} | {r['n']} | {name}"
          f" | {t['median_ms'] * 1e3:.1f} | {t['tflops']:.0f}"
          f" | {t.get('vs_cublas', float('nan')):.3f}"
          f" | {t.get('vs_xla_dus', float('nan')):.3f} |")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  app.run(main)
