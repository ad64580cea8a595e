"""Suite ``moe``: the MoE layer (dispatch, experts, combine) against XLA.

Per model of ``shapes.json``'s ``moe_models`` (d_model H, expert width F,
E experts, top_k), tokens per device (``--moe_tokens``) and routing
(``--routings``: ``balanced``, every expert equally likely; ``zipf``,
expert i drawn with weight 1 / (i + 1)^1.2, the same hot experts on every
device), one forward pass of the layer on each device's ``T * top_k``
routed rows: ``all_to_all_matmul`` (through ``w1 [E, H, F]``), GELU,
``matmul_all_to_all`` (through ``w2 [E, F, H]``), bf16. With
``--moe_pass=train`` every program and baseline is its training pass
instead, the gradients for x, w1 and w2 (``moe_train.json``).

Programs, timed interleaved and each checked once against an f32
reference (every expert on every device, ``lax.ragged_dot`` alone):

* ``xla_ragged``: ``lax.ragged_all_to_all`` into the receive buffer, a
  local sort of the received rows by expert, ``lax.ragged_dot`` twice,
  the unsort, and ``lax.ragged_all_to_all`` back (GPU only: XLA:CPU has no
  ragged all-to-all);
* ``xla_dense``: GShard-style slots, ``[P, E_l, slot, d]`` rows per
  device with ``slot`` the most rows any (device, expert) pair has, one
  ``lax.all_to_all`` each way and the experts as dense batched einsums;
* ``ficco <label>``: the ficco ops under each ``--moe_schedules`` label
  (``default``: ``schedule=None``; ``none``: one ``lax.all_to_all`` each way; ``direct``: a piece per
  peer; ``direct/c1/dma``: the pieces of both on the copy engines;
  ``.../pallas``: the experts on ficco's grouped matmul instead of
  ``lax.ragged_dot``), with ``check_routing=False`` (the routing is valid
  by construction, and XLA's programs have no such check either).

``xla_best`` is the fastest correct of XLA's programs: ``xla_ragged``,
``xla_dense``, and ``ficco none`` (XLA's all_to_all plus
``lax.ragged_dot``). The ideal is ``max(compute alone, exchange alone)``:
the two grouped matmuls with no exchange, the faster of ``ragged_dot`` and
ficco's kernel (on this device's own counts, which stand in for the
received ones: the same where balanced, fewer than the hottest device's
under Zipf), and the two all-to-alls of ficco's pieces (``P *
piece_capacity`` rows) with no matmul. Every static size is as tight as
the routing allows (drawn on the host, seeded), for every program alike:
the capacity is the most rows any device receives, the piece capacity the
most one device sends another, the dense slot the most of one (device,
expert) pair; nothing is dropped.
"""

from __future__ import annotations

import gc
import json

from absl import flags

from lib import internal
from lib import jax_util
from lib import meta as meta_lib
from lib import options
from lib import programs
from lib import report
from lib import results
from lib import timing

FLAGS = flags.FLAGS
flags.DEFINE_list("moe_models", [], "moe: models of shapes.json's moe_models"
                  " (default: all).")
flags.DEFINE_list("moe_tokens", [], "moe: tokens per device (default:"
                  " shapes.json's moe_tokens_per_device).")
flags.DEFINE_list("routings", ["balanced", "zipf"], "moe: routings.")
flags.DEFINE_list("moe_schedules", ["default", "none", "direct",
                                    "direct/c1/dma",
                                    "none/c1/xla/pallas",
                                    "direct/c1/xla/pallas",
                                    "direct/c1/dma/pallas"],
                  "moe: ficco schedules to time: default (schedule=None), a"
                  " dataflow (none, direct) or"
                  " a Schedule label (direct/c1/dma: the copy engines;"
                  " .../pallas: ficco's grouped matmul).")

flags.DEFINE_enum("moe_pass", "forward", ["forward", "train"],
                  "moe: time the layer's forward pass, or its training"
                  " pass (forward and backward: the gradients of"
                  " 0.5 * sum(y^2) for x, w1 and w2, every program and"
                  " baseline alike, checked against the f32 reference's).")

ZIPF_S = 1.2
# XLA's own programs: ragged_all_to_all + ragged_dot, GShard-style slots +
# dense einsum, each also compiled with XLA's overlap options (the
# latency-hiding scheduler and windowed einsums: XLA at its best, GPU or
# --xla_overlap=on), and ficco's "none" on XLA's compute (one all_to_all +
# ragged_dot). xla_best is the fastest correct one.
XLA_PROGRAMS = ("xla_ragged", "xla_dense", "xla_ragged_overlap",
                "xla_dense_overlap", "ficco none")


def routing(kind: str, p: int, e: int, rows: int, seed: int):
  """``[P, E]`` rows per expert on each device (each row sums to ``rows``)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  if kind == "balanced":
    probs = np.ones(e) / e
  elif kind == "zipf":
    probs = 1.0 / np.arange(1, e + 1) ** ZIPF_S
    probs /= probs.sum()
  else:
    raise ValueError(f"--routings: unknown routing {kind!r}")
  return rng.multinomial(rows, probs, size=p).astype(np.int32)


def _programs(mesh, p, e_local, rows, capacity, piece, slot):
  """name -> jitted ``f(x, w1, w2, gs)`` over global arrays."""
  import jax
  from jax import lax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  import ficco_jax
  from ficco_jax import Schedule

  spec = (P("x"), P("x"), P("x"), P("x"))

  # Off GPUs compute="pallas" runs Pallas's interpreter, which shard_map's
  # varying-axes check rejects.
  on_gpu = jax.default_backend() == "gpu"

  def sm(body, pallas=False):
    return jax_util.jit_shard_map(body, mesh, spec, P("x"),
                                  check_vma=on_gpu or not pallas)

  def ficco(label):
    if label == "default":
      sched = None  # schedule=None: what the ops pick (moe/api.py).
    else:
      sched = (Schedule.from_short(label) if "/" in label
               else Schedule(dataflow=label))

    def body(x, w1, w2, gs):
      h = ficco_jax.all_to_all_matmul(x, w1, gs[0], axis_name="x",
                                      capacity=capacity,
                                      piece_capacity=piece, schedule=sched,
                                      check_routing=False)
      h = jax.nn.gelu(h).astype(x.dtype)
      return ficco_jax.matmul_all_to_all(h, w2, gs[0], axis_name="x",
                                         num_tokens=rows,
                                         piece_capacity=piece, schedule=sched,
                                         check_routing=False)
    return sm(body, pallas=sched is not None and sched.compute == "pallas")

  def excl(v):
    return jnp.cumsum(v) - v

  def xla_ragged(x, w1, w2, gs):
    send = gs[0].reshape(p, e_local)
    send_tot, recv = send.sum(1), lax.all_to_all(send, "x", 0, 0, tiled=True)
    recv_tot = recv.sum(1)
    in_off, recv_off = excl(send_tot), excl(recv_tot)
    # Where this device's rows start on each receiver, and the reverse.
    out_off = lax.all_to_all(recv_off, "x", 0, 0, tiled=True)
    back_off = lax.all_to_all(in_off, "x", 0, 0, tiled=True)
    got = lax.ragged_all_to_all(x, jnp.zeros((capacity, x.shape[1]), x.dtype),
                                in_off, send_tot, out_off, recv_tot,
                                axis_name="x")
    expert = jnp.repeat(jnp.tile(jnp.arange(e_local), p), recv.reshape(-1),
                        total_repeat_length=capacity)
    expert = jnp.where(jnp.arange(capacity) < recv_tot.sum(), expert,
                       e_local)
    order = jnp.argsort(expert, stable=True)
    sizes = recv.sum(0)
    h = jax.nn.gelu(lax.ragged_dot(got[order], w1, sizes)).astype(x.dtype)
    y = lax.ragged_dot(h, w2, sizes).astype(x.dtype)
    y = jnp.zeros_like(y).at[order].set(y)
    return lax.ragged_all_to_all(y, jnp.zeros((rows, y.shape[1]), y.dtype),
                                 recv_off, recv_tot, back_off, send_tot,
                                 axis_name="x")

  def xla_dense(x, w1, w2, gs):
    # GShard-style: a slot of `slot` rows per (destination, local expert),
    # one all_to_all each way, the experts as one batched dense einsum.
    send = gs[0].reshape(p, e_local)
    start = excl(gs[0]).reshape(p, e_local)
    i = jnp.arange(slot)
    idx = start[:, :, None] + i  # [P, E_l, slot] token rows
    ok = i < send[:, :, None]
    xs = jnp.where(ok[..., None], x[jnp.where(ok, idx, 0)], 0)
    got = lax.all_to_all(xs, "x", 0, 0, tiled=True)  # [P src, E_l, slot, d]
    got = got.transpose(1, 0, 2, 3).reshape(e_local, p * slot, -1)
    h = jax.nn.gelu(jnp.einsum("erd,edf->erf", got, w1)).astype(x.dtype)
    y = jnp.einsum("erf,efd->erd", h, w2).astype(x.dtype)
    y = y.reshape(e_local, p, slot, -1).transpose(1, 0, 2, 3)
    back = lax.all_to_all(y, "x", 0, 0, tiled=True)  # [P dest, E_l, slot, d]
    back = jnp.where(ok[..., None], back, 0)
    return jnp.zeros((rows, back.shape[-1]), back.dtype).at[
        jnp.where(ok, idx, rows)].add(back, mode="drop")

  def reference(x, w1, w2, gs):
    w1 = lax.all_gather(w1, "x", tiled=True).astype(jnp.float32)
    w2 = lax.all_gather(w2, "x", tiled=True).astype(jnp.float32)
    h = jax.nn.gelu(lax.ragged_dot(x.astype(jnp.float32), w1, gs[0]))
    return lax.ragged_dot(h, w2, gs[0])

  def compute_alone(dot):
    def body(x, w1, w2, gs):
      # The received rows' work without the exchange: this device's counts
      # stand in for the received ones (the same sizes where balanced).
      sizes = gs[0].reshape(p, e_local).sum(0)
      xs = jnp.pad(x, ((0, capacity - rows), (0, 0)))[:capacity]
      h = jax.nn.gelu(dot(xs, w1, sizes)).astype(x.dtype)
      return dot(h, w2, sizes).astype(x.dtype)[:rows]
    return body

  gmm = internal.grouped_matmul().grouped_matmul

  def exchange_alone(x, w1, w2, gs):
    del w1, w2, gs
    pieces = jnp.broadcast_to(x[:piece], (p, piece, x.shape[1]))
    there = lax.all_to_all(pieces, "x", 0, 0, tiled=True)
    back = lax.all_to_all(there, "x", 0, 0, tiled=True)
    return back.reshape(-1, x.shape[1])[:rows]

  progs = {f"ficco {d}": ficco(d) for d in FLAGS.moe_schedules}
  progs["xla_ragged"] = sm(xla_ragged)
  progs["xla_dense"] = sm(xla_dense)
  computes = {"compute": sm(compute_alone(lax.ragged_dot)),
              "compute_pallas": sm(compute_alone(gmm), pallas=True)}
  return progs, sm(reference), computes, sm(exchange_alone)


def _train(fn):
  """``fn(x, w1, w2, gs) -> y`` as its training pass: the gradients of
  ``0.5 * sum(y^2)`` (so the cotangent is y itself) for x, w1 and w2."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def step(x, w1, w2, gs):
    def loss(x, w1, w2):
      y = fn(x, w1, w2, gs).astype(jnp.float32)
      return 0.5 * jnp.sum(y * y)
    return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
  return step


def measure_case(rec, mesh, name, cfg, tokens, kind, seed) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P
  p = mesh.shape["x"]
  h_dim, f_dim, e, k = cfg["H"], cfg["F"], cfg["E"], cfg["top_k"]
  if FLAGS.tiny:
    h_dim, f_dim = max(64, h_dim // 32), max(64, f_dim // 32)
    tokens = max(64, tokens // 32)
  rows = tokens * k
  gs = routing(kind, p, e, rows, seed)
  e_local = e // p
  recv = gs.reshape(p, p, e_local).sum(2)  # [source, dest]
  # Static sizes as tight as this routing allows, for every program alike:
  # rows a device receives, rows one peer sends it, rows of one (source,
  # expert) pair (xla_dense's slot).
  capacity = int(recv.sum(0).max())
  piece = int(recv.max())
  slot = int(gs.max())
  c = {"name": f"{name}/T{tokens}/{kind}", "W": p, "H": h_dim, "F": f_dim,
       "E": e, "top_k": k, "tokens_per_device": tokens, "routing": kind,
       "rows_per_device": rows, "capacity": capacity,
       "piece_capacity": piece, "dense_slot": slot,
       "max_over_mean_received": float(recv.sum(0).max() / recv.sum(0).mean()),
       "baselines": {}, "programs": {}}
  tag = f"moe {c['name']} W={p}"
  sets = []
  for i in range(max(1, FLAGS.input_sets)):
    sets.append((
        jax_util.random_array(mesh, (p * rows, h_dim), P("x"), 10 * i + 1),
        jax_util.random_array(mesh, (e, h_dim, f_dim), P("x"), 10 * i + 2) *
        (1 / np.sqrt(h_dim)).astype(np.float32).item(),
        jax_util.random_array(mesh, (e, f_dim, h_dim), P("x"), 10 * i + 3) *
        (1 / np.sqrt(f_dim)).astype(np.float32).item(),
        jax.device_put(gs, jax.sharding.NamedSharding(mesh, P("x")))))
  sets = [tuple(a.astype(jnp.bfloat16) if a.dtype != jnp.int32 else a
                for a in s) for s in sets]
  progs, ref_fn, computes, exchange_fn = _programs(
      mesh, p, e_local, rows, capacity, piece, slot)
  if FLAGS.moe_pass == "train":
    progs = {n: _train(f) for n, f in progs.items()}
    computes = {n: _train(f) for n, f in computes.items()}
    ref_fn, exchange_fn = _train(ref_fn), _train(exchange_fn)
  overlap_notes = {}
  if _overlap_wanted():
    for base in ("xla_ragged", "xla_dense"):
      progs[f"{base}_overlap"] = _overlapped(progs[base], sets[0],
                                             overlap_notes, base)
  tk = options.timing_kwargs()
  for bname, fn in (*computes.items(), ("exchange", exchange_fn)):
    c["baselines"][bname] = results.guarded(
        rec, f"{tag} {bname} alone",
        lambda fn=fn: timing.time_jax(fn, sets, **tk, interleave=False))
  ref32 = ref_fn(*sets[0])
  with timing.interleaved():
    for pname, fn in progs.items():
      c["programs"][pname] = results.guarded(
          rec, f"{tag} {pname}", lambda fn=fn: jax_util.measure(
              lambda cv, fn=fn: fn, args=sets, ref32=ref32, xla_err=None,
              tol=FLAGS.tol if "tol" in FLAGS else 2e-2, tk=tk))
    rec.progress(f"{tag}: timing round-robin")
  for base, notes in overlap_notes.items():
    c["programs"][f"{base}_overlap"].update(notes)
  summarize_case(c)
  return c


def _overlap_wanted() -> bool:
  """XLA's overlap options: on GPUs (``--xla_overlap=auto``), or asked."""
  import jax
  if FLAGS.xla_overlap == "off":
    return False
  return FLAGS.xla_overlap == "on" or jax.devices()[0].platform == "gpu"


def _overlapped(fn, args, notes: dict, base: str):
  """``fn`` compiled with XLA's overlap options, at its first call (inside
  the guarded measurement, so that a failure is recorded, not raised);
  ``notes[base]`` gets the options used and refused."""
  compiled = []

  def call(*a):
    if not compiled:
      exe, notes[base] = programs.compile_overlapped(fn.lower(*args))
      compiled.append(exe)
    return compiled[0](*a)
  return call


def summarize_case(c: dict) -> None:
  ok = lambda r: r.get("median_ms") and r.get("ok", True) and "error" not in r
  xla = {n: r for n, r in c["programs"].items()
         if n in XLA_PROGRAMS and ok(r)}
  if xla:
    best = min(xla, key=lambda n: xla[n]["median_ms"])
    c["xla_best"] = {"program": best, "median_ms": xla[best]["median_ms"]}
  b = c["baselines"]
  computes = [b[n]["median_ms"] for n in ("compute", "compute_pallas")
              if b.get(n, {}).get("median_ms")]
  if computes and b.get("exchange", {}).get("median_ms"):
    c["ideal_ms"] = max(min(computes), b["exchange"]["median_ms"])
  for n, r in c["programs"].items():
    if ok(r) and "xla_best" in c:
      r["speedup"] = c["xla_best"]["median_ms"] / r["median_ms"]


def run() -> int:
  import jax
  w = FLAGS.axis_size or jax.device_count()
  meta = meta_lib.collect("moe")
  with open(FLAGS.shapes) as f:
    shapes = json.load(f)
  models = FLAGS.moe_models or list(shapes["moe_models"])
  tokens = [int(t) for t in (FLAGS.moe_tokens or
                             shapes["moe_tokens_per_device"])]
  data = {"meta": meta, "timing": options.configure_timing(), "axis_size": w,
          "pass": FLAGS.moe_pass, "cases": []}
  rec = results.Recorder("moe" if FLAGS.moe_pass == "forward" else
                         "moe_train",
                         results.out_dir(meta["device_kind"], w), data,
                         markdown)
  mesh = jax_util.mesh_of(w)
  seed = 0
  for name in models:
    cfg = shapes["moe_models"][name]
    for t in tokens:
      for kind in FLAGS.routings:
        seed += 1
        what = f"moe {name}/T{t}/{kind} W={w}"
        if cfg["E"] % w:
          rec.skip(what, f"E={cfg['E']} experts do not split over {w}")
          continue
        if rec.over_budget():
          rec.skip(what, "time budget")
          continue
        data["cases"].append(measure_case(rec, mesh, name, cfg, t, kind,
                                          seed))
        rec.save()
        gc.collect()
        jax.clear_caches()
  rec.finish()
  return 0


def markdown(data: dict) -> str:
  import math
  train = data.get("pass") == "train"
  lines = [f"# MoE layer{' training pass' if train else ''}: dispatch +"
           f" experts + combine{', forward and backward' if train else ''},"
           f" W={data['axis_size']}", ""]
  lines += report.provenance(data["meta"]) + [
      "", "ms per call, median over rounds (min), interleaved; speedup over"
      " xla_best (the fastest correct of `xla_ragged`, `xla_dense`, the"
      " two compiled with XLA's overlap options (`_overlap`: the"
      " latency-hiding scheduler and windowed einsums; GPU, or"
      " --xla_overlap=on) and `ficco none`, XLA's compute)."
      " Ideal: max(the faster compute alone, exchange alone).", ""]
  names = sorted({n for c in data["cases"] for n in c["programs"]})
  rows, speedups = [], {n: [] for n in names}
  for c in data["cases"]:
    row = [c["name"], str(c["capacity"]),
           f"{c['max_over_mean_received']:.2f}",
           report.times(c["baselines"].get("compute")),
           report.times(c["baselines"].get("compute_pallas")),
           report.times(c["baselines"].get("exchange"))]
    for n in names:
      r = c["programs"].get(n, {})
      if "error" in r:
        row.append("error")
      elif r.get("ok") is False:
        row.append(f"wrong ({r.get('rel_err', 0):.3g})")
      else:
        s = r.get("speedup")
        row.append(report.times(r) + (f" ({s:.2f}x)" if s else ""))
        if s:
          speedups[n].append(s)
    rows.append(row)
  lines += report.table(["case", "capacity", "max/mean received",
                         "compute alone (ragged_dot)",
                         "compute alone (grouped kernel)", "exchange alone",
                         *names], rows)
  lines += ["", "| program | cases | geomean speedup | min |", "|---|---|---|---|"]
  for n, v in speedups.items():
    if v:
      g = math.exp(sum(math.log(x) for x in v) / len(v))
      lines.append(f"| {n} | {len(v)} | {g:.3f} | {min(v):.3f} |")
  return "\n".join(lines + report.skipped(data)) + "\n"
