"""Suite ``kernel``: ficco's Pallas chunk kernel against XLA's dot, one device.

``--kernel_mode=chunks`` (default): for the chunk shapes of the
tensor-parallel matmuls (per device at axis size W):
  all-gather side   x [mc, H]   @ w [H, F/W]
  reduce-scatter    h [mc, F/W] @ w [F/W, H]
with chunk rows mc in ``--mcs``, it times
  xla_dot      XLA's dot into a fresh [mc, n] (cuBLAS: the reference)
  xla_dot_dus  XLA's dot, then dynamic_update_slice into the big output
  pallas       chunk_matmul_into (the Hopper kernel, default config)
  pallas/smN   the same with num_sms=N (``--num_sms``)
  pallas/cfg:  the tile-config sweep (``--tune``)
One jitted call writes all W chunks of a [W * mc, n] output (W kernels,
traced offsets c * mc), the output donated so every call updates it in
place as the overlapped dataflows do; times are per chunk (call / W).

``--kernel_mode=pieces``: the reduce-scatter's one-launch kernels on the
ten shapes' per-device sizes (h [M, F/W] @ w [F/W, H], W pieces of M/W
rows): XLA's dot of all rows, W launches of one piece each, one launch of
all pieces, one flagged launch (bumping a completion flag per piece, as
the flagged granularity does) and one landed launch (each CTA waiting on a
landing flag per piece, as the signalled all-gather's kernel does; every
flag already set, so it times what the waits themselves cost);
interleaved.

``--kernel_mode=grouped_dw``: the same shapes' weight gradient (dw of
each group from its rows of x and of the cotangent): XLA's dense einsum
over equal slots, XLA's transpose of ``ragged_dot`` (what the op ran before
the GPU kernel) and jax's transposed grouped kernel, chosen and under each
``--grouped_blocks`` tile of jax's kind; ``--grouped_dx`` adds the input
gradient ``ct @ w[g].T`` on ficco's kernel, reading w transposed where it
lies and from a transposed copy.

``--kernel_mode=grouped``: the MoE ops' grouped matmul per
``shapes.json`` ``moe_models`` model, cut for W devices (E/W local experts),
``--grouped_rows`` rows split evenly over them (``--grouped_jitter`` moves
the boundaries off the tiles), both of the layer's matmuls
(``d -> f``, ``f -> d``): XLA's dense batched einsum over equal slots (the
dense-slot baseline with nothing padded), ``lax.ragged_dot``, and the
grouped kernel under each ``--grouped_blocks`` tile config; interleaved,
each checked once against an f32 reference. The sizes are constants of
the program, so XLA folds the kernel's tile table away;
``--grouped_runtime_sizes`` adds the chosen tiles with sizes known only at
run time, as a layer's routing is.

Each shape is first checked once: output poisoned with NaN, relative error
against an f32 dot, rows outside the chunk still NaN.
"""

from __future__ import annotations

from absl import flags

from lib import cases as cases_lib
from lib import internal
from lib import meta as meta_lib
from lib import options
from lib import report
from lib import results
from lib import timing

FLAGS = flags.FLAGS
flags.DEFINE_enum("kernel_mode", "chunks",
                  ["chunks", "pieces", "grouped", "grouped_dw"],
                  "kernel: chunk kernel vs XLA, the reduce-scatter's"
                  " one-launch and flagged kernels, the MoE grouped"
                  " matmul, or its weight gradient.")
flags.DEFINE_integer("grouped_rows", 8192, "kernel: grouped mode's rows.")
flags.DEFINE_integer("grouped_jitter", 0,
                     "kernel: grouped mode's groups alternate between"
                     " slot + J and slot - J rows (same total), so that"
                     " group boundaries cut the kernels' row tiles as real"
                     " routing does; the dense baseline keeps equal slots.")
flags.DEFINE_bool("grouped_zero_pass", False,
                  "kernel: grouped mode also times the chosen tiles followed"
                  " by XLA's pass that zeroes the rows past the groups (what"
                  " the kernel's own zero stores replace).")
flags.DEFINE_bool("grouped_runtime_sizes", False,
                  "kernel: grouped mode also times the chosen tiles with the"
                  " group sizes known only at run time, as a layer's routing"
                  " is (behind a barrier; the other programs' constant sizes"
                  " let XLA fold the tile table into the program).")
flags.DEFINE_bool("grouped_dx", False,
                  "kernel: grouped_dw mode also times the input gradient"
                  " dx = ct @ w[g].T, with ficco's kernel reading w"
                  " transposed where it lies and from a transposed copy.")
flags.DEFINE_list("grouped_blocks", ["ws-64x256-s3-e256-wm-gm8",
                                     "ws-64x256-s4-e128-wm-gm8",
                                     "ws-64x256-s3-e256-wm-gn8",
                                     "ws-64x256-s3-e256-wm-gm16",
                                     "ws-128x128-s3-e128-wm-gm8",
                                     "ws-64x128-s4-e128-wm-gm8",
                                     "128x128x64x4x4"],
                  "kernel: grouped mode's tile configs: ficco's kernel as"
                  " ws-<tile_m>x<tile_n>-s<stages>-e<epilogue columns>-w"
                  "<warpgroup split m|n>-g<walk's minor dim m|n><band"
                  " width>, jax's as block_m x block_n x block_k x"
                  " max_concurrent_steps x grid_block_n.")
flags.DEFINE_list("mcs", ["512", "1024", "2048", "4096"],
                  "kernel: chunk rows mc.")
flags.DEFINE_list("num_sms", ["132", "112", "96"], "kernel: num_sms values.")
flags.DEFINE_bool("tune", False, "kernel: also sweep tile configs.")


def _tile_configs(cm) -> dict:
  c = cm.ChunkMatmulConfig
  return {
      "128x256/wgM(64x256)": c(tile_m=64, tile_n=256, wg_dimension="m"),
      "128x256/wgM(64x256)/w8": c(tile_m=64, tile_n=256, wg_dimension="m",
                                  grid_tile_width=8),
      "128x256/wgN(128x128)": c(tile_m=128, tile_n=128, wg_dimension="n"),
      "256x128/wgM(128x128)": c(tile_m=128, tile_n=128, wg_dimension="m"),
      "128x128/wgM(64x128)": c(tile_m=64, tile_n=128, wg_dimension="m"),
  }


def _check(cm, mc, k, n, w) -> dict:
  """One kernel call into a NaN-poisoned output, against an f32 dot."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  x = jax.random.normal(jax.random.key(1), (mc, k), jnp.bfloat16)
  wt = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
  ref = jnp.dot(x.astype(jnp.float32), wt.astype(jnp.float32),
                precision=lax.Precision.HIGHEST)
  off = (w - 1) * mc
  out = jnp.full((w * mc, n), jnp.nan, jnp.bfloat16)
  res = jax.jit(lambda o, x, wt: cm.chunk_matmul_into(o, x, wt, off))(out, x, wt)
  got = res[off:off + mc].astype(jnp.float32)
  rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
  untouched = bool(jnp.isnan(res[:off]).all())
  return {"rel_err": rel, "untouched_rows_nan": untouched,
          "ok": bool(rel < 1e-2 and untouched)}


def _chunk_shapes(models: dict, w: int):
  for model in FLAGS.models:
    h, f_ = models[model]["H"], models[model]["F"]
    if FLAGS.tiny:
      h, f_ = cases_lib.tiny_dim(h), cases_lib.tiny_dim(f_)
    for op in FLAGS.ops:
      k, n = (h, f_ // w) if op == "ag" else (f_ // w, h)
      for mc in map(int, FLAGS.mcs):
        yield model, op, (cases_lib.tiny_dim(mc) if FLAGS.tiny else mc), k, n


def run_chunks(rec, cm, w: int) -> None:
  import json
  import jax
  import jax.numpy as jnp
  from jax import lax
  with open(FLAGS.shapes) as f:
    models = json.load(f)["models"]
  tk = options.timing_kwargs()
  num_sms = getattr(jax.devices()[0], "core_count", None)
  for model, op, mc, k, n in _chunk_shapes(models, w):
    what = f"{model} {op} mc={mc} K={k} n={n}"
    if rec.over_budget():
      rec.skip(what, "time budget")
      continue
    row = {"model": model, "op": op, "mc": mc, "K": k, "n": n,
           "chunks_per_call": w, "times": {}}
    row["check"] = results.guarded(rec, f"{what} check",
                                   lambda: _check(cm, mc, k, n, w))
    keys = jax.random.split(jax.random.key(mc + k + n), 2 * w + 1)
    x_sets = [tuple(jax.random.normal(keys[s * w + c], (mc, k), jnp.bfloat16)
                    for c in range(w)) for s in range(2)]
    wt = jax.random.normal(keys[-1], (k, n), jnp.bfloat16)
    offs = jnp.arange(w, dtype=jnp.int32) * mc  # Traced offsets.
    arg_sets = [(xs, wt, offs) for xs in x_sets]

    def dot(x, wt):
      return lax.dot_general(x, wt, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32
                             ).astype(jnp.bfloat16)

    def variant(chunk_fn, out0):
      def step(out, xs, wt, offs):
        for c in range(w):
          out = chunk_fn(out, xs[c], wt, offs[c])
        return out
      _, t = timing.time_chain(jax.jit(step, donate_argnums=0), out0,
                               arg_sets, **tk)
      for key in ("median_ms", "min_ms"):
        t[key] /= w
      t["rounds_ms"] = [v / w for v in t["rounds_ms"]]
      t["tflops"] = 2.0 * mc * k * n / (t["median_ms"] * 1e-3) / 1e12
      return t

    big = lambda: jnp.zeros((w * mc, n), jnp.bfloat16)  # noqa: E731
    programs = {
        # Each chunk's dot into a fresh [mc, n]; the carried tuple keeps all
        # W results alive (and donated, so reused).
        "xla_dot": (lambda o, x, wt, i: o[1:] + (dot(x, wt),),
                    lambda: tuple(jnp.zeros((mc, n), jnp.bfloat16)
                                  for _ in range(w))),
        "xla_dot_dus": (lambda o, x, wt, i: lax.dynamic_update_slice(
            o, dot(x, wt), (i, jnp.int32(0))), big),
        "pallas": (lambda o, x, wt, i: cm.chunk_matmul_into(o, x, wt, i), big),
    }
    for s in map(int, FLAGS.num_sms):
      programs[f"pallas/sm{s}"] = (
          lambda o, x, wt, i, s=s: cm.chunk_matmul_into(o, x, wt, i,
                                                        num_sms=s), big)
    if FLAGS.tune:
      for name, cfg in _tile_configs(cm).items():
        try:
          cfg.check_shapes(mc, n, k)
        except ValueError:
          continue  # This tile does not divide the shape.
        programs[f"pallas/cfg:{name}"] = (
            lambda o, x, wt, i, cfg=cfg: cm.chunk_matmul_into(
                o, x, wt, i, config=cfg), big)
    try:
      row["default_config"] = str(cm.default_config(mc, k, n,
                                                    num_sms=num_sms or 132))
    except Exception as e:  # pylint: disable=broad-except
      row["default_config"] = f"none: {results.short_error(e, 200)}"
    for name, (fn, out0) in programs.items():
      row["times"][name] = results.guarded(
          rec, f"{what} {name}", lambda fn=fn, out0=out0: variant(fn, out0()))
    for ref in ("xla_dot", "xla_dot_dus"):
      t_ref = row["times"][ref].get("median_ms")
      for t in row["times"].values():
        if t_ref and t.get("median_ms"):
          t[f"vs_{ref}"] = t_ref / t["median_ms"]
    rec.data["rows"].append(row)
    rec.save()


def run_pieces(rec, cm, w: int) -> None:
  """One-launch and flagged reduce-scatter kernels on the ten shapes."""
  import jax
  import jax.numpy as jnp
  tk = options.timing_kwargs()
  cases = options.case_list("rs") if (FLAGS.cases or FLAGS.preset
                                      or FLAGS["models"].present) else \
      cases_lib.build("rs", shapes_path=FLAGS.shapes, tiny=FLAGS.tiny,
                      **cases_lib.PRESETS["ten"])
  for case in cases:
    if rec.over_budget():
      rec.skip(case.name, "time budget")
      continue
    m, k, n = case.m, case.k // w, case.n
    rows = m // w
    keys = jax.random.split(jax.random.key(0), 4)
    hs = [jax.random.normal(keys[i], (m, k), jnp.bfloat16) for i in range(2)]
    ws = [jax.random.normal(keys[2 + i], (k, n), jnp.bfloat16) / k ** 0.5
          for i in range(2)]
    padded = k != cm.padded_k(k)
    if padded:  # As the reduce-scatter does when K is not a multiple of 64.
      hs = [cm.pad_k(h) for h in hs]
    starts = [i * rows for i in range(w)]
    kw = dict(x_zero_padded_k=padded)
    variants = {
        "xla": lambda h, wt: jnp.dot(h[:, :k], wt),
        "pieces": lambda h, wt: [cm.chunk_matmul_pieces(h, [r], rows, wt, **kw)
                                 for r in starts],
        "one": lambda h, wt: cm.chunk_matmul_pieces(h, starts, rows, wt, **kw),
        "flagged": lambda h, wt: cm.chunk_matmul_pieces(
            h, starts, rows, wt, _flags=jnp.zeros((w,), jnp.int32), **kw),
        "landed": lambda h, wt: cm.chunk_matmul_pieces(
            h, starts, rows, wt, landed=(jnp.ones((w,), jnp.int32),
                                         list(range(w))), **kw),
    }
    rec_case = {"name": case.name, "local": {"h": [m, k], "w": [k, n],
                                             "rows": rows}, "methods": {}}
    with timing.interleaved():
      for name, fn in variants.items():
        rec_case["methods"][name] = results.guarded(
            rec, f"{case.name} {name}", lambda fn=fn: timing.time_jax(
                jax.jit(fn), list(zip(hs, ws)), **tk))
    base = rec_case["methods"]["pieces"].get("median_ms")
    for t in rec_case["methods"].values():
      if base and t.get("median_ms"):
        t["vs_pieces"] = base / t["median_ms"]
    rec.data["rows"].append(rec_case)
    rec.save()


def parse_grouped_label(label: str):
  """A ``--grouped_blocks`` label as the tiles `grouped_matmul` takes."""
  gm = internal.grouped_matmul()
  if label.startswith("ws-"):
    import re
    got = re.fullmatch(
        r"ws-(\d+)x(\d+)-s(\d+)-e(\d+)-w([mn])-g([mn])(\d+)", label)
    if got is None:
      raise ValueError(f"--grouped_blocks: {label!r} is not"
                       " ws-<tm>x<tn>-s<stages>-e<cols>-w<m|n>-g<m|n><width>.")
    tm, tn, steps, epi = map(int, got.group(1, 2, 3, 4))
    return internal.chunk_matmul().ChunkMatmulConfig(
        tile_m=tm, tile_n=tn, max_concurrent_steps=steps, epi_tile_m=tm,
        epi_tile_n=epi, wg_dimension=got.group(5),
        grid_minor_dim=got.group(6), grid_tile_width=int(got.group(7)))
  bm, bn, bk, steps, gbn = map(int, label.split("x"))
  return gm.Block(block_m=bm, block_n=bn, block_k=bk,
                  max_concurrent_steps=steps, grid_block_n=gbn)


def grouped_label(block) -> str:
  """`parse_grouped_label`'s label of ``block``."""
  import dataclasses
  if isinstance(block, internal.grouped_matmul().Block):
    return "x".join(str(v) for v in dataclasses.astuple(block))
  return (f"ws-{block.tile_m}x{block.tile_n}-s{block.max_concurrent_steps}"
          f"-e{block.epi_tile_n}-w{block.wg_dimension}"
          f"-g{block.grid_minor_dim}{block.grid_tile_width}")


def _grouped_programs(gm, blocks, keys, e, slot, sizes, k, n, skip):
  """The forward pass: (input sets, references by program name (None: the
  others'), programs) for ``x [rows, k]`` in groups ``sizes`` times
  ``w [e, k, n]``."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  rows = e * slot
  sets = [(jax.random.normal(keys[i], (rows, k), jnp.bfloat16),
           jax.random.normal(keys[2 + i], (e, k, n), jnp.bfloat16)
           / k ** 0.5) for i in range(2)]
  f32 = [a.astype(jnp.float32) for a in sets[0]]
  # The dense baseline's slots are equal whatever the jitter.
  refs = {None: lax.ragged_dot(*f32, sizes),
          "dense": lax.ragged_dot(*f32, jnp.full((e,), slot, jnp.int32))}
  programs = {
      "dense": lambda x, wt: jnp.einsum(
          "erk,ekn->ern", x.reshape(e, slot, k), wt).reshape(rows, n),
      "ragged_dot": lambda x, wt: lax.ragged_dot(x, wt, sizes),
  }
  # What the MoE ops run: the library's choice (grouped_matmul.
  # choose_block), then each swept tile that suits the shape.
  chosen = gm.choose_block(k, n, jnp.bfloat16)
  programs[f"grouped (chosen: {grouped_label(chosen)})"] = (
      lambda x, wt: gm.grouped_matmul(x, wt, sizes))
  if FLAGS.grouped_zero_pass:
    # What the zero stores of ficco's kernel replace: XLA's pass over the
    # result that zeroes the rows past the groups (the sizes behind a
    # barrier, as a layer's routing is: not folded away).
    programs["grouped (chosen) + XLA zero pass"] = (
        lambda x, wt: gm.zero_past_groups(gm.grouped_matmul(x, wt, sizes),
                                          lax.optimization_barrier(sizes)))
  if FLAGS.grouped_runtime_sizes:
    programs["grouped (chosen), sizes at run time"] = (
        lambda x, wt: gm.grouped_matmul(x, wt,
                                        lax.optimization_barrier(sizes)))
  for label, block in blocks.items():
    # Off GPUs the portable kernel runs whatever the tiles.
    why = gm.mosaic_unfit(k, n, jnp.bfloat16, block)
    if why is not None and jax.default_backend() == "gpu":
      skip(label, why)
      continue
    programs[f"grouped/{label}"] = (
        lambda x, wt, block=block: gm.grouped_matmul(x, wt, sizes,
                                                     block=block))
  return sets, refs, programs


def _grouped_dw_programs(gm, blocks, keys, e, slot, sizes, k, n, skip):
  """The weight gradient: ``dw [e, k, n]`` of x ``[rows, k]`` and the
  cotangent ``[rows, n]`` (as `_grouped_programs`); with
  ``--grouped_dx``, also the input gradient ``ct @ w[g].T`` (w
  ``[e, k, n]``), read in place and from a transposed copy."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  rows = e * slot
  sets = [(jax.random.normal(keys[i], (rows, k), jnp.bfloat16),
           jax.random.normal(keys[2 + i], (rows, n), jnp.bfloat16),
           jax.random.normal(keys[i], (e, k, n), jnp.bfloat16) / n ** 0.5)
          for i in range(2)]

  def xla(x, ct, w=None, sizes=sizes):  # What the op runs off the kernel.
    del w
    w0 = jnp.zeros((e, k, n), jnp.float32)
    _, vjp = jax.vjp(lambda w: lax.ragged_dot(
        x, w, sizes, preferred_element_type=jnp.float32), w0)
    return vjp(ct.astype(jnp.float32))[0].astype(x.dtype)

  f32 = [a.astype(jnp.float32) for a in sets[0]]
  refs = {None: xla(*f32), "dense": xla(*f32, sizes=jnp.full(
      (e,), slot, jnp.int32))}
  programs = {
      "dense": lambda x, ct, w: jnp.einsum(
          "erk,ern->ekn", x.reshape(e, slot, k), ct.reshape(e, slot, n)),
      "ragged_dot": xla,
  }
  if jax.default_backend() != "gpu":  # The kernel is GPU-only.
    return sets, refs, programs
  chosen = gm.choose_dw_block(k, n, jnp.bfloat16)
  programs[f"dw (chosen: {grouped_label(chosen)})"] = (
      lambda x, ct, w: gm.mosaic_dw(x, ct, sizes))
  if FLAGS.grouped_dx:
    # pylint: disable=protected-access
    dx = lambda ct, w, transposed: gm._impl(
        ct, w, sizes, jnp.bfloat16, True, None, transpose_w=transposed)
    programs["dx, w read transposed"] = (
        lambda x, ct, w: dx(ct, w, True))
    programs["dx, from a transposed copy of w"] = (
        lambda x, ct, w: dx(ct, jnp.swapaxes(w, 1, 2), False))
    ref_dx = lax.ragged_dot(f32[1], jnp.swapaxes(f32[2], 1, 2), sizes)
    refs["dx, w read transposed"] = ref_dx
    refs["dx, from a transposed copy of w"] = ref_dx
  for label, block in blocks.items():
    why = (gm.dw_unfit(k, n, jnp.bfloat16, jnp.bfloat16, block)
           if isinstance(block, gm.Block) else "not a dw tile")
    if why is not None:
      skip(label, why)
      continue
    programs[f"dw/{label}"] = (
        lambda x, ct, w, block=block: gm.mosaic_dw(x, ct, sizes, block))
  return sets, refs, programs


def run_grouped(rec, w: int, dw: bool = False) -> None:
  """The MoE grouped matmul (or, ``dw``, its weight gradient) against
  XLA's dense einsum and ragged_dot."""
  import json
  import jax
  import jax.numpy as jnp
  gm = internal.grouped_matmul()
  blocks = {label: parse_grouped_label(label)
            for label in FLAGS.grouped_blocks}  # Bad labels fail first.
  with open(FLAGS.shapes) as f:
    models = json.load(f)["moe_models"]
  tk = options.timing_kwargs()
  for model in FLAGS.moe_models or list(models):  # suites/moe.py's flag.
    cfg = models[model]
    e = cfg["E"] // w
    h, f_ = cfg["H"], cfg["F"]
    if FLAGS.tiny:
      h, f_ = cases_lib.tiny_dim(h), cases_lib.tiny_dim(f_)
    rows = FLAGS.grouped_rows // e * e
    slot = rows // e
    jitter = [FLAGS.grouped_jitter * (-1) ** i for i in range(e)]
    jitter[-1] -= sum(jitter)  # The same rows in all.
    if not 0 <= FLAGS.grouped_jitter <= slot // 2:
      raise ValueError(f"--grouped_jitter={FLAGS.grouped_jitter} must be in"
                       f" [0, {slot // 2}] ({model}: {slot} rows per group).")
    sizes = jnp.asarray([slot + j for j in jitter], jnp.int32)
    for k, n in ((h, f_), (f_, h)):
      what = f"{model} E_l={e} rows={rows} K={k} N={n}"
      if rec.over_budget():
        rec.skip(what, "time budget")
        continue
      keys = jax.random.split(jax.random.key(k + n), 4)
      build = _grouped_dw_programs if dw else _grouped_programs
      sets, refs, programs = build(gm, blocks, keys, e, slot, sizes, k, n,
                                   skip=lambda label, why: rec.skip(
                                       f"{what} grouped/{label}", why))
      row = {"model": model, "E_l": e, "rows": rows, "K": k, "N": n,
             "group_sizes": [int(v) for v in sizes], "times": {}}
      flops = 2.0 * rows * k * n
      with timing.interleaved():
        for name, fn in programs.items():
          def timed(fn=fn, ref=refs.get(name, refs[None])):
            fn = jax.jit(fn)
            got = fn(*sets[0]).astype(jnp.float32)
            rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            t = timing.time_jax(fn, sets, **tk)  # Filled in after the
            t.update(rel_err=rel, ok=rel < 2e-2)  # round-robin.
            return t
          row["times"][name] = results.guarded(rec, f"{what} {name}", timed)
      base = row["times"]["dense"].get("median_ms")
      for t in row["times"].values():
        if t.get("median_ms"):
          t["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
          if base:
            t["vs_dense"] = base / t["median_ms"]
      rec.data["rows"].append(row)
      rec.save()


def run() -> int:
  import jax
  w = FLAGS.axis_size or 4  # The axis size the per-device shapes are cut for.
  meta = meta_lib.collect("kernel")
  data = {"meta": meta, "timing": options.configure_timing(), "axis_size": w,
          "mode": FLAGS.kernel_mode, "device_sms":
          getattr(jax.devices()[0], "core_count", None), "rows": []}
  rec = results.Recorder(f"kernel_{FLAGS.kernel_mode}",
                         results.out_dir(meta["device_kind"], 1), data,
                         markdown)
  if FLAGS.kernel_mode in ("grouped", "grouped_dw"):
    run_grouped(rec, w, dw=FLAGS.kernel_mode == "grouped_dw")
  else:
    cm = internal.chunk_matmul()
    (run_chunks if FLAGS.kernel_mode == "chunks" else run_pieces)(rec, cm, w)
  rec.finish()
  return 0


def markdown(data: dict) -> str:
  what = {"grouped": "MoE grouped matmul",
          "grouped_dw": "MoE grouped matmul's weight gradient"}.get(
              data["mode"], f"Pallas chunk kernel ({data['mode']})")
  lines = [f"# {what} vs XLA, one GPU, shapes cut for W={data['axis_size']}",
           ""]
  lines += report.provenance(data["meta"]) + [""]
  if data["mode"] == "chunks":
    lines += ["Per chunk: median us (min), TFLOP/s, and speed against XLA's"
              " dot and XLA's dot + update-slice (> 1: faster).", ""]
    rows = []
    for r in data["rows"]:
      chk = r.get("check", {})
      for name, t in r["times"].items():
        if "median_ms" not in t:
          rows.append([r["model"], r["op"], r["mc"], r["K"], r["n"], name,
                       t.get("error", "error")[:100], "", "", "", ""])
          continue
        rows.append([r["model"], r["op"], r["mc"], r["K"], r["n"], name,
                     f"{t['median_ms'] * 1e3:.1f} ({t['min_ms'] * 1e3:.1f})",
                     f"{t['tflops']:.0f}", report.num(t.get("vs_xla_dot")),
                     report.num(t.get("vs_xla_dot_dus")),
                     ("ok" if chk.get("ok") else f"CHECK {chk}"[:80])
                     if name == "pallas" else ""])
    lines += report.table(["model", "op", "mc", "K", "n", "program",
                           "us (min)", "TFLOP/s", "vs dot", "vs dot+DUS",
                           "check"], rows)
  elif data["mode"] in ("grouped", "grouped_dw"):
    lines += ["Per call: median ms (min), TFLOP/s, speed against the dense"
              " einsum (> 1: faster), relative error against f32."
              + (" The weight gradient dw [E_l, K, N] of x [rows, K] and"
                 " the cotangent [rows, N]; the dx rows: the input"
                 " gradient ct @ w[g].T [rows, K] (its flops are dw's)."
                 if data["mode"] == "grouped_dw" else ""), ""]
    rows = []
    for r in data["rows"]:
      for name, t in r["times"].items():
        if "median_ms" not in t:
          rows.append([r["model"], r["E_l"], r["rows"], r["K"], r["N"], name,
                       t.get("error", "error")[:100], "", "", ""])
          continue
        rows.append([r["model"], r["E_l"], r["rows"], r["K"], r["N"], name,
                     f"{t['median_ms']:.3f} ({t['min_ms']:.3f})",
                     f"{t['tflops']:.0f}", report.num(t.get("vs_dense")),
                     f"{t['rel_err']:.2g}" + ("" if t["ok"] else " WRONG")])
    lines += report.table(["model", "E_l", "rows", "K", "N", "program",
                           "ms (min)", "TFLOP/s", "vs dense", "rel err"],
                          rows)
  else:
    names = ["xla", "pieces", "one", "flagged", "landed"]
    rows = []
    for c in data["rows"]:
      cells = []
      for v in names:
        t = c["methods"].get(v, {})
        cells.append(f"{t['median_ms']:.4f} ({report.num(t.get('vs_pieces'))}x)"
                     if t.get("median_ms") else "error")
      rows.append([c["name"]] + cells)
    lines += ["Median ms per call (speed against W one-piece launches).", ""]
    lines += report.table(["case"] + names, rows)
  return "\n".join(lines + report.skipped(data)) + "\n"
