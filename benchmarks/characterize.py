"""Measures what the cost model needs: decomposition, contention, copy throughput.

Three sections (FiCCO's characterisation), each within a share of one time
budget, every measurement failing soft (its error is recorded) and the JSON
rewritten after each one:

  decomposition  bf16 [m, K] @ [K, n] on one device, cut into c row chunks
                 (c in --chunks, each dot written into its rows of one output
                 as the library does) vs unsplit, for the per-device shapes of
                 the benchmark models (m = M/P, K = H, n = F/P, P in
                 --axis_sizes); plus single dots of (P-1)*m/c rows, the
                 compute granularity of the direct dataflow.
  contention     on the first --contention_p devices: a matmul alone, a
                 copy-engine gather (ficco comm="dma", direct plan: every
                 device pulls S MiB from each peer) alone, and both in one
                 program, issued together; per engine in --engines ("xla":
                 the same plan over lax.ppermute).
  copy           the gather alone for P in 2..4 devices and sizes S in
                 --copy_mib: per-device receive GB/s vs size and peers.

Timing: benchmarks/timing.py (jit, warm-up, median over rounds of
back-to-back calls, one block per round).

  python3 benchmarks/characterize.py --out_dir=/tmp/char      # ~3.5 min
  python3 benchmarks/characterize.py --tiny --time_budget_s=60  # CPU smoke

Fit the cost model from the result with benchmarks/fit_cost_model.py.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import timing  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", os.path.join(HERE, "results"), "Output folder.")
flags.DEFINE_string("tag", None, "File tag (default: platform_Ndev).")
flags.DEFINE_list("sections", ["decomposition", "contention", "copy"],
                  "Sections to run, in this order.")
flags.DEFINE_float("time_budget_s", 210.0,
                   "Soft budget: no measurement starts after it (0: none).")
flags.DEFINE_list("shares", ["0.45", "0.3", "0.25"],
                  "Fractions of the budget for the sections, in order.")
flags.DEFINE_string("shapes", os.path.join(HERE, "shapes.json"), "Shapes file.")
flags.DEFINE_list("models", ["llama3-70b", "llama3-8b", "llama3-405b"],
                  "Models of shapes.json for the decomposition section.")
flags.DEFINE_list("tokens", ["8192", "2048", "16384"], "Global token counts M.")
flags.DEFINE_list("axis_sizes", ["4", "2"], "P for the per-device shapes.")
flags.DEFINE_list("chunks", ["1", "2", "4", "8"], "Chunk counts c.")
flags.DEFINE_list("engines", ["dma", "xla"], "Copy engines: dma, xla.")
flags.DEFINE_integer("contention_p", 4, "Devices in the contention section.")
flags.DEFINE_list("contention_mib", ["16", "64", "256"],
                  "MiB pulled from each peer in the contention section.")
flags.DEFINE_list("contention_mm", ["8192x8192x7168", "2048x8192x2048"],
                  "Matmuls [m x K x n] run against the copies.")
flags.DEFINE_list("copy_mib", ["1", "4", "16", "64", "256"],
                  "MiB pulled from each peer in the copy section.")
flags.DEFINE_integer("row_elems", 4096, "bf16 elements per copied row.")
flags.DEFINE_integer("warmup", 3, "Warm-up calls (the first compiles).")
flags.DEFINE_integer("rounds", 5, "Timed rounds.")
flags.DEFINE_integer("iters", 10, "Back-to-back calls per round.")
flags.DEFINE_bool("tiny", False, "Divide every size by 64 (CPU smoke run).")


# ---------------------------------------------------------------- run state


class Recorder:
  """Holds the results and rewrites the JSON after every measurement."""

  def __init__(self):
    import jax
    dev = jax.devices()[0]
    tag = FLAGS.tag or f"{dev.platform}_{len(jax.devices())}dev"
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    self.path = os.path.join(FLAGS.out_dir, f"characterize_{tag}.json")
    self.t0 = time.perf_counter()
    self.data = {
        "meta": {
            "command": " ".join([sys.executable] + sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": socket.gethostname(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "platform": dev.platform,
            "device_kind": dev.device_kind,
            "device_count": len(jax.devices()),
            "xla_flags": os.environ.get("XLA_FLAGS"),
            "timing": {"warmup": FLAGS.warmup, "rounds": FLAGS.rounds,
                       "iters": FLAGS.iters,
                       "stat": "median/min over rounds of round_time/iters"},
            "tiny": FLAGS.tiny,
        },
        "decomposition": [], "contention": [], "copy": [], "skipped": [],
    }
    self.deadline = float("inf")

  def over(self) -> bool:
    return time.perf_counter() > self.deadline

  def measure(self, section: str, record: dict, fn) -> dict:
    """Runs ``fn() -> timing dict`` into ``record``; errors are recorded."""
    if self.over():
      self.data["skipped"].append({"section": section, **record})
      return record
    label = " ".join(f"{k}={v}" for k, v in record.items())
    print(f"[{time.perf_counter() - self.t0:6.1f}s] {section}: {label}",
          flush=True)
    try:
      res = fn()
      record.update({k: res[k] for k in ("median_ms", "min_ms")})
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc(limit=3)
      record["error"] = f"{type(e).__name__}: {e}"[:800]
    self.data[section].append(record)
    self.save()
    gc.collect()
    return record

  def save(self) -> None:
    self.data["elapsed_s"] = time.perf_counter() - self.t0
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(tmp, self.path)


def _tk():
  return dict(warmup=FLAGS.warmup, rounds=FLAGS.rounds, iters=FLAGS.iters)


def _scale(d: int) -> int:
  return max(8, d // 64) if FLAGS.tiny else d


def _rand(shape, key, sharding=None):
  import jax
  import jax.numpy as jnp
  gen = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16),
                out_shardings=sharding)
  return gen(jax.random.key(key))


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


def decomposition(rec: Recorder) -> None:
  with open(FLAGS.shapes) as f:
    models = json.load(f)["models"]
  chunks = [int(c) for c in FLAGS.chunks]
  seen = set()
  for p in (int(v) for v in FLAGS.axis_sizes):
    for name in FLAGS.models:
      h, ff = _scale(models[name]["H"]), _scale(models[name]["F"])
      for m_glob in (int(t) for t in FLAGS.tokens):
        m, k, n = _scale(m_glob) // p, h, ff // p
        if m_glob % p or ff % p:
          continue
        args = [(_rand((m, k), 2 * i), _rand((k, n), 2 * i + 1))
                for i in range(2)]
        for c in chunks:
          if m % c or ("split", m, k, n, c) in seen:
            continue
          seen.add(("split", m, k, n, c))
          rec.measure("decomposition", {
              "kind": "split", "P": p, "model": name, "M": m_glob, "rows": m,
              "K": k, "n": n, "chunks": c, "piece_rows": m // c},
              lambda c=c, args=args: timing.time_jax(_split_dot(c), args,
                                                  **_tk()))
        # The direct dataflow multiplies (P - 1) * m / c rows at a time.
        for c in chunks:
          rows = (p - 1) * m // c
          if m % c or rows < 1 or ("piece", rows, k, n) in seen:
            continue
          seen.add(("piece", rows, k, n))
          pargs = [(_rand((rows, k), 2 * i + 7), b) for i, (_, b) in
                   enumerate(args)]
          rec.measure("decomposition", {
              "kind": "direct_piece", "P": p, "model": name, "M": m_glob,
              "rows": m, "K": k, "n": n, "chunks": c, "piece_rows": rows},
              lambda pargs=pargs: timing.time_jax(_split_dot(1), pargs,
                                                  **_tk()))
        del args


# ---------------------------------------------------------------- copies


def _mesh(p: int):
  import jax
  import numpy as np
  return jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))


def _gather_fn(mesh, engine: str, mm: bool):
  """shard_map program: a direct-plan gather, optionally with an independent
  matmul issued right after the copies start (so the two overlap)."""
  import jax
  from jax import lax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from ficco_jax import Schedule
  from ficco_jax._src import gather
  from ficco_jax._src import plan as plan_lib

  p = mesh.shape["x"]

  def body(buf, a, b):
    gplan = plan_lib.gather_plan(Schedule(dataflow="direct", num_chunks=1),
                                 axis_size=p, shard_rows=buf.shape[0])

    def consume(carry, data, blocks):
      total, out = carry
      if blocks[0].landing < 0 and mm:
        # Tied to the local shard, which the dma engine orders after start:
        # the matmul runs while the copies are in flight.
        a2, _ = lax.optimization_barrier((a, data))
        out = a2 @ b
      return total + data[0, 0].astype(jnp.float32), out

    init = (jnp.zeros((), jnp.float32),
            jnp.zeros((a.shape[0], b.shape[1]), a.dtype))
    (total, out), keep = gather.run(buf, gplan, axis_name="x", comm=engine,
                                    consume=consume, carry=init,
                                    op_name="characterize", timeout_s=60.0)
    total = gather.finish(total.reshape(1), keep, comm=engine,
                          axis_name="x", op_name="characterize",
                          timeout_s=60.0)
    return total, out[None]

  return jax.jit(jax.shard_map(body, mesh=mesh,
                               in_specs=(P("x"), P("x"), P("x")),
                               out_specs=(P("x"), P("x"))))


def _mm_fn(mesh):
  import jax
  from jax.sharding import PartitionSpec as P
  return jax.jit(jax.shard_map(lambda a, b: (a @ b)[None], mesh=mesh,
                               in_specs=(P("x"), P("x")), out_specs=P("x")))


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


def contention(rec: Recorder) -> None:
  import jax
  p = min(FLAGS.contention_p, len(jax.devices()))
  mesh = _mesh(p)
  for mm_spec in FLAGS.contention_mm:
    mm_shape = tuple(int(v) for v in mm_spec.lower().split("x"))
    _, a, b, _ = _buffers(mesh, 1, mm_shape, 100)
    base = {"P": p, "mm": list(mm_shape)}
    rec.measure("contention", {**base, "what": "mm_alone"},
                lambda: timing.time_jax(_mm_fn(mesh), [(a, b)], **_tk()))
    # Operands of a negligible matmul: "copy alone" runs the same program
    # without the matmul (mm=False), these only fill its arguments.
    _, a0, b0, _ = _buffers(mesh, 1, (8, 8, 8), 300)
    for engine in FLAGS.engines:
      for mib in (float(v) for v in FLAGS.contention_mib):
        buf, _, _, nbytes = _buffers(mesh, mib, (8, 8, 8), 200)
        info = {**base, "engine": engine, "mib_per_peer": mib,
                "bytes_per_peer": nbytes}
        rec.measure("contention", {**info, "what": "copy_alone"},
                    lambda buf=buf, engine=engine: timing.time_jax(
                        _gather_fn(mesh, engine, mm=False), [(buf, a0, b0)],
                        **_tk()))
        rec.measure("contention", {**info, "what": "both"},
                    lambda buf=buf, engine=engine: timing.time_jax(
                        _gather_fn(mesh, engine, mm=True), [(buf, a, b)],
                        **_tk()))
        del buf


def copy_throughput(rec: Recorder) -> None:
  import jax
  for engine in FLAGS.engines:
    for p in range(2, min(4, len(jax.devices())) + 1):
      mesh = _mesh(p)
      for mib in (float(v) for v in FLAGS.copy_mib):
        buf, a, b, nbytes = _buffers(mesh, mib, (8, 8, 8), 400)
        r = rec.measure("copy", {
            "engine": engine, "P": p, "peers": p - 1, "mib_per_peer": mib,
            "bytes_per_peer": nbytes},
            lambda buf=buf, a=a, b=b, mesh=mesh, engine=engine:
            timing.time_jax(_gather_fn(mesh, engine, mm=False), [(buf, a, b)],
                            **_tk()))
        if r.get("median_ms"):
          r["receive_gbps"] = (p - 1) * nbytes / (r["median_ms"] * 1e-3) / 1e9
        del buf


SECTIONS = {"decomposition": decomposition, "contention": contention,
            "copy": copy_throughput}


def main(argv):
  del argv
  rec = Recorder()
  shares = [float(s) for s in FLAGS.shares]
  names = [s for s in FLAGS.sections if s in SECTIONS]
  start = time.perf_counter()
  for i, name in enumerate(names):
    if FLAGS.time_budget_s > 0:
      # Each section gets its share of what is left, so an early section
      # that finishes quickly leaves its time to the later ones.
      left = FLAGS.time_budget_s - (time.perf_counter() - start)
      rest = [shares[min(j, len(shares) - 1)] for j in range(i, len(names))]
      frac = rest[0] / sum(rest)
      rec.deadline = time.perf_counter() + max(0.0, left * frac)
    try:
      SECTIONS[name](rec)
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      rec.data["skipped"].append({"section": name,
                                  "error": f"{type(e).__name__}: {e}"[:800]})
    rec.save()
    import jax
    jax.clear_caches()
  print(f"wrote {rec.path}", flush=True)


if __name__ == "__main__":
  app.run(main)
