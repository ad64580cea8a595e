"""Suite ``characterize``: what the cost model needs, measured; then fitted.

Three sections, each within a share of ``--time_budget_s``, every
measurement failing soft (its error is recorded) and the JSON rewritten after
each one:

  decomposition  bf16 [m, K] @ [K, n] on one device cut into c row chunks
                 (c in --chunks; each dot written into its rows of one output
                 as the library does) vs unsplit, for the per-device shapes
                 of the models (m = M/P, K = H, n = F/P, P in
                 --char_axis_sizes); plus single dots of (P-1)*m/c rows, the
                 compute granularity of the direct dataflow.
  contention     on the first --contention_p devices: a matmul alone, a
                 copy-engine gather (direct plan: every device pulls S MiB
                 from each peer) alone, and both in one program, issued
                 together; per engine in --engines ("xla": the same plan
                 over lax.ppermute) and per matmul in --contention_compute
                 (XLA's dot, or ficco's Pallas kernel with its occupancy
                 knob, num_sms: what leaving SMs idle buys under overlap).
  copy           the gather alone for P in 2..4 devices and sizes S in
                 --copy_mib: per-device receive GB/s vs size and peers.

Writes ``characterize.json`` (format: ``meta``, ``decomposition``,
``contention``, ``copy``, ``skipped``, and ``contention_summary``: per
matmul and compute label, the share of the shorter side that overlap hid)
and the stage-1 fit of it
(lib/fit.py) as ``device_params.json``, the override file format
``device_params.params_for`` reads (``{"device_kind", "source", "params"}``).

The gather sections drive ficco's gather primitive directly
(``ficco_jax._src.gather`` and ``plan``): no public API moves bytes without
a matmul. If that internal API has moved, they record why and the
decomposition section still runs.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time

from absl import flags

from lib import fit as fit_lib
from lib import internal
from lib import meta as meta_lib
from lib import options
from lib import results
from lib import timing

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", ["decomposition", "contention", "copy"],
                  "characterize: sections to run, in order.")
flags.DEFINE_list("shares", ["0.45", "0.3", "0.25"],
                  "characterize: fractions of the budget per section.")
flags.DEFINE_list("char_axis_sizes", ["4", "2"],
                  "characterize: P of the per-device shapes.")
flags.DEFINE_list("chunks", ["1", "2", "4", "8"], "characterize: chunks c.")
flags.DEFINE_list("engines", ["dma", "xla"], "characterize: copy engines.")
flags.DEFINE_integer("contention_p", 4, "characterize: devices of the"
                     " contention section.")
flags.DEFINE_list("contention_mib", ["16", "64", "256"],
                  "characterize: MiB pulled from each peer (contention).")
flags.DEFINE_list("contention_mm", ["8192x8192x7168", "2048x8192x2048"],
                  "characterize: matmuls [m x K x n] run against the copies.")
flags.DEFINE_list("contention_compute", ["xla"],
                  "characterize: the contention section's matmuls: xla"
                  " (XLA's dot; the only one the cost model's fit reads),"
                  " pallas (ficco's Pallas kernel on every SM), pallas/smN"
                  " (the same with num_sms=N).")
flags.DEFINE_list("copy_mib", ["1", "4", "16", "64", "256"],
                  "characterize: MiB pulled from each peer (copy).")
flags.DEFINE_integer("row_elems", 4096, "characterize: bf16 per copied row.")
flags.DEFINE_float("peak_flops", None, "characterize: the peak the fitted"
                   " efficiencies are relative to (default: the kind's).")

# Without --models / --tokens: the shapes the shipped fit was measured on.
MODELS = ["llama3-70b", "llama3-8b", "llama3-405b"]
TOKENS = ["8192", "2048", "16384"]


def _scale(d: int) -> int:
  return max(8, d // 64) if FLAGS.tiny else d


def _rand(shape, key, sharding=None):
  import jax
  import jax.numpy as jnp
  gen = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16),
                out_shardings=sharding)
  return gen(jax.random.key(key))


class _Sections:
  """The recorder and the running section's deadline (its budget share)."""

  def __init__(self, rec: results.Recorder):
    self.rec = rec
    self.deadline = float("inf")


def _measure(run: _Sections, section: str, record: dict, fn) -> dict:
  """Runs ``fn() -> timing dict`` into ``record`` (errors recorded)."""
  rec = run.rec
  if time.perf_counter() > run.deadline:
    rec.data["skipped"].append({"section": section, **record})
    return record
  label = " ".join(f"{k}={v}" for k, v in record.items())
  res = results.guarded(rec, f"{section}: {label}", fn)
  if "error" in res:
    record["error"] = res["error"]
  else:
    record.update({k: res[k] for k in ("median_ms", "min_ms")})
  rec.data[section].append(record)
  rec.save()
  gc.collect()
  return record


# ---------------------------------------------------------------- decomposition


def _split_dot(c: int):
  """[m, K] @ [K, n] as c row-chunk dots written into one output."""
  import jax
  from jax import lax
  import jax.numpy as jnp

  @jax.jit
  def f(a, b):
    m = a.shape[0]
    mc = m // c
    if c == 1:
      return a @ b
    out = jnp.zeros((m, b.shape[1]), a.dtype)
    for i in range(c):
      y = lax.slice_in_dim(a, i * mc, (i + 1) * mc) @ b
      out = lax.dynamic_update_slice_in_dim(out, y, i * mc, axis=0)
    return out
  return f


def decomposition(run) -> None:
  with open(FLAGS.shapes) as f:
    models = json.load(f)["models"]
  chunks = [int(c) for c in FLAGS.chunks]
  names = FLAGS.models if FLAGS["models"].present else MODELS
  tokens = FLAGS.tokens if FLAGS["tokens"].present else TOKENS
  tk = options.timing_kwargs()
  seen = set()
  for p in (int(v) for v in FLAGS.char_axis_sizes):
    for name in names:
      h, ff = _scale(models[name]["H"]), _scale(models[name]["F"])
      for m_glob in (int(t) for t in tokens):
        m, k, n = _scale(m_glob) // p, h, ff // p
        if m_glob % p or ff % p:
          continue
        args = [(_rand((m, k), 2 * i), _rand((k, n), 2 * i + 1))
                for i in range(2)]
        for c in chunks:
          if m % c or ("split", m, k, n, c) in seen:
            continue
          seen.add(("split", m, k, n, c))
          _measure(run, "decomposition", {
              "kind": "split", "P": p, "model": name, "M": m_glob, "rows": m,
              "K": k, "n": n, "chunks": c, "piece_rows": m // c},
              lambda c=c, args=args: timing.time_jax(_split_dot(c), args,
                                                     **tk))
        # The direct dataflow multiplies (P - 1) * m / c rows at a time.
        for c in chunks:
          rows = (p - 1) * m // c
          if m % c or rows < 1 or ("piece", rows, k, n) in seen:
            continue
          seen.add(("piece", rows, k, n))
          pargs = [(_rand((rows, k), 2 * i + 7), b)
                   for i, (_, b) in enumerate(args)]
          _measure(run, "decomposition", {
              "kind": "direct_piece", "P": p, "model": name, "M": m_glob,
              "rows": m, "K": k, "n": n, "chunks": c, "piece_rows": rows},
              lambda pargs=pargs: timing.time_jax(_split_dot(1), pargs, **tk))


# ---------------------------------------------------------------- copies


def _mesh(p: int):
  import jax
  import numpy as np
  return jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))


def _gather_api(engine: str, p: int):
  """(run, finish) of ficco's gather engine on ``engine``."""
  from ficco_jax import Schedule

  gather = internal.gather()
  st = internal.matmul().make_static(
      "all_gather_matmul", axis_name="x", axis_size=p,
      schedule=Schedule(dataflow="direct", num_chunks=1, comm=engine),
      precision=None, preferred_element_type=None, timeout_s=60.0)
  return (lambda buf, gplan, **c: gather.run(buf, gplan, st, **c),
          lambda result, keep: gather.finish(result, keep, st))


def _gather_fn(mesh, engine: str, mm: bool, compute: str = "xla"):
  """shard_map program: a direct-plan gather, optionally with an independent
  matmul (``compute``, a --contention_compute label) issued right after the
  copies start (so the two overlap)."""
  import jax
  from jax import lax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from ficco_jax import Schedule
  plan_lib = internal.plan()

  p = mesh.shape["x"]
  run, finish = _gather_api(engine, p)
  matmul = _compute(compute)

  def body(buf, a, b):
    gplan = plan_lib.gather_plan(Schedule(dataflow="direct", num_chunks=1),
                                 axis_size=p, shard_rows=buf.shape[0])

    def consume(carry, data, blocks):
      total, out = carry
      if blocks[0].landing < 0 and mm:
        # Tied to the local shard, which the dma engine orders after start:
        # the matmul runs while the copies are in flight.
        a2, _ = lax.optimization_barrier((a, data))
        out = matmul(a2, b)
      return total + data[0, 0].astype(jnp.float32), out

    init = (jnp.zeros((), jnp.float32),
            jnp.zeros((a.shape[0], b.shape[1]), a.dtype))
    (total, out), keep = run(buf, gplan, consume=consume, carry=init)
    return finish(total.reshape(1), keep), out[None]

  return jax.jit(jax.shard_map(body, mesh=mesh,
                               in_specs=(P("x"), P("x"), P("x")),
                               out_specs=(P("x"), P("x")),
                               check_vma=_check_vma(compute)))


def _compute(label: str):
  """``(a, b) -> a @ b`` for a --contention_compute label."""
  if label == "xla":
    return lambda a, b: a @ b
  m = re.fullmatch(r"pallas(?:/sm([1-9][0-9]*))?", label)
  if m is None:
    raise ValueError(f"--contention_compute={label!r}: expected xla, pallas"
                     " or pallas/smN with N a positive int.")
  num_sms = int(m.group(1)) if m.group(1) else None
  cm = internal.chunk_matmul()
  return lambda a, b: cm.chunk_matmul(a, b, num_sms=num_sms)


def _check_vma(compute: str) -> bool:
  # Off GPUs the Pallas kernel runs in Pallas's interpreter, which does not
  # take shard_map's varying-axes checks (the library says so if asked).
  return compute == "xla"


def _mm_fn(mesh, compute: str):
  import jax
  from jax.sharding import PartitionSpec as P
  mm = _compute(compute)
  return jax.jit(jax.shard_map(lambda a, b: mm(a, b)[None], mesh=mesh,
                               in_specs=(P("x"), P("x")), out_specs=P("x"),
                               check_vma=_check_vma(compute)))


def _buffers(mesh, mib: float, mm_shape, key: int):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  p = mesh.shape["x"]
  sh = NamedSharding(mesh, P("x"))
  row = _scale(FLAGS.row_elems)
  target = mib * (1 << 20) / (4096 if FLAGS.tiny else 1)
  rows = max(1, int(target // (row * 2)))  # bf16 rows of `row` elements.
  m, k, n = (_scale(d) for d in mm_shape)
  buf = _rand((p * rows, row), key, sh)
  a = _rand((p * m, k), key + 1, sh)
  b = _rand((p * k, n), key + 2, sh)
  return buf, a, b, rows * row * 2


def contention(run) -> None:
  import jax
  p = min(FLAGS.contention_p, len(jax.devices()))
  mesh = _mesh(p)
  tk = options.timing_kwargs()
  for label in FLAGS.contention_compute:
    _compute(label)  # A label it cannot read fails before anything runs.
  for mm_spec in FLAGS.contention_mm:
    mm_shape = tuple(int(v) for v in mm_spec.lower().split("x"))
    _, a, b, _ = _buffers(mesh, 1, mm_shape, 100)
    # Operands of a negligible matmul: "copy alone" runs the same program
    # without the matmul (mm=False); these only fill its arguments.
    _, a0, b0, _ = _buffers(mesh, 1, (8, 8, 8), 300)
    for compute in FLAGS.contention_compute:
      base = {"P": p, "mm": list(mm_shape), "compute": compute}
      _measure(run, "contention", {**base, "what": "mm_alone"},
               lambda compute=compute: timing.time_jax(
                   _mm_fn(mesh, compute), [(a, b)], **tk))
      for engine in FLAGS.engines:
        for mib in (float(v) for v in FLAGS.contention_mib):
          buf, _, _, nbytes = _buffers(mesh, mib, (8, 8, 8), 200)
          info = {**base, "engine": engine, "mib_per_peer": mib,
                  "bytes_per_peer": nbytes}
          if compute == FLAGS.contention_compute[0]:
            # The copies alone do not depend on the matmul: once per size.
            _measure(run, "contention", {**info, "what": "copy_alone"},
                     lambda buf=buf, engine=engine: timing.time_jax(
                         _gather_fn(mesh, engine, mm=False),
                         [(buf, a0, b0)], **tk))
          _measure(run, "contention", {**info, "what": "both"},
                   lambda buf=buf, engine=engine, compute=compute:
                   timing.time_jax(_gather_fn(mesh, engine, mm=True,
                                              compute=compute),
                                   [(buf, a, b)], **tk))


def copy_throughput(run) -> None:
  import jax
  tk = options.timing_kwargs()
  for engine in FLAGS.engines:
    for p in range(2, min(4, len(jax.devices())) + 1):
      mesh = _mesh(p)
      for mib in (float(v) for v in FLAGS.copy_mib):
        buf, a, b, nbytes = _buffers(mesh, mib, (8, 8, 8), 400)
        r = _measure(run, "copy", {
            "engine": engine, "P": p, "peers": p - 1, "mib_per_peer": mib,
            "bytes_per_peer": nbytes},
            lambda buf=buf, a=a, b=b, mesh=mesh, engine=engine:
            timing.time_jax(_gather_fn(mesh, engine, mm=False), [(buf, a, b)],
                            **tk))
        if r.get("median_ms"):
          r["receive_gbps"] = (p - 1) * nbytes / (r["median_ms"] * 1e-3) / 1e9


SECTIONS = {"decomposition": decomposition, "contention": contention,
            "copy": copy_throughput}


def run() -> int:
  import jax
  meta = meta_lib.collect("characterize")
  meta["timing"] = options.configure_timing()
  meta["tiny"] = FLAGS.tiny
  data = {"meta": meta, "decomposition": [], "contention": [], "copy": [],
          "skipped": []}
  directory = results.out_dir(meta["device_kind"], meta["device_count"])
  rec = results.Recorder("characterize", directory, data, None)
  run_state = _Sections(rec)
  shares = [float(s) for s in FLAGS.shares]
  names = [s for s in FLAGS.sections if s in SECTIONS]
  start = time.perf_counter()
  for i, name in enumerate(names):
    if FLAGS.time_budget_s > 0:
      # Each section gets its share of what is left, so an early section
      # that finishes quickly leaves its time to the later ones.
      left = FLAGS.time_budget_s - (time.perf_counter() - start)
      rest = [shares[min(j, len(shares) - 1)] for j in range(i, len(names))]
      run_state.deadline = time.perf_counter() + max(
          0.0, left * rest[0] / sum(rest))
    try:
      SECTIONS[name](run_state)
    except Exception as e:  # pylint: disable=broad-except
      rec.data["skipped"].append({"section": name,
                                  "error": results.short_error(e, 800)})
    rec.save()
    jax.clear_caches()
  data["contention_summary"] = fit_lib.contention_summary(data["contention"])
  rec.finish()
  try:
    fitted = fit_lib.fit(data, peak_flops=FLAGS.peak_flops)
  except Exception as e:  # pylint: disable=broad-except
    fitted = {"error": results.short_error(e)}
  path = os.path.join(directory, "device_params.json")
  results.write_json(path, fitted)
  print(f"wrote {path}", flush=True)
  return 0
