"""A tensor-parallel transformer trained with ficco_jax's collective matmuls.

Megatron-style tensor parallelism with sequence parallelism, written pjit
style: global arrays with ``NamedSharding`` on a ``dp x tp`` mesh under
``jax.jit``. The residual stream ``[B, S, D]`` is sharded (batch over "dp",
sequence over "tp"), so RMSNorm and the residual adds are local. Every
projection into the model's wide dimension is column-parallel and starts with
an all-gather of the sequence; every projection back is row-parallel and ends
with a reduce-scatter onto the sequence:

  x ─ RMSNorm ─ all_gather_matmul(QKV) ─ causal attention, heads over tp ─
      matmul_reduce_scatter(out proj) ─ + ─ RMSNorm ─
      all_gather_matmul(up) ─ gelu ─ matmul_reduce_scatter(down) ─ +

``Config.layers`` such blocks run under ``lax.scan`` over their stacked
parameters (one compiled block, as large models are written), each
optionally rematerialized in the backward pass (``Config.remat``).

With ``use_ficco=True`` those four matmuls are
`ficco_jax.sharded.all_gather_matmul` / `matmul_reduce_scatter`, which overlap
the collective with the matmul. With ``use_ficco=False`` they are plain
``x @ w`` and sharding constraints pin the same layouts, so XLA inserts the
all-gathers and reduce-scatters itself: the same model, the same parameters,
the reference the demo (and the test) compare losses against.

Run with ficco_jax installed (8 virtual CPU devices as a 2x4 mesh when
there is no GPU):

  python examples/tp_transformer.py
  python examples/tp_transformer.py --layers=4 --remat
  python examples/tp_transformer.py --schedule=ring:2:xla
  python examples/tp_transformer.py --schedule=direct:2:dma --dtype=bfloat16
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

if __name__ == "__main__":
  # Must precede jax's backend initialisation. Only sizes the CPU platform,
  # so it is harmless on GPU hosts.
  _flag = "--xla_force_host_platform_device_count=8"
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax

DP, TP = "dp", "tp"
# The residual stream: batch over dp, sequence over tp (sequence parallel).
SEQ_PARALLEL = P(DP, TP)
# What a column-parallel matmul leaves: the whole sequence, columns over tp.
COL_PARALLEL = P(DP, None, TP)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Model sizes; frozen so it can be a jit static argument."""

  d_model: int
  heads: int
  d_ff: int
  dtype: Any = jnp.float32  # Compute dtype; parameters stay float32.
  # "xla": the einsum softmax below; "cudnn": jax.nn.dot_product_attention's
  # fused GPU kernel (bf16/f16 only), for long sequences on GPUs.
  attention: str = "xla"
  layers: int = 1  # Blocks, scanned over their stacked parameters.
  remat: bool = False  # Recompute each block's activations for its grads.

  def __post_init__(self):
    if isinstance(self.layers, bool) or not isinstance(self.layers, int) or (
        self.layers < 1):
      raise ValueError(f"{self.layers=} must be a positive int.")
    if self.d_model % self.heads:
      raise ValueError(f"{self.heads=} must divide {self.d_model=}.")
    if self.attention not in ("xla", "cudnn"):
      raise ValueError(f"{self.attention=} must be 'xla' or 'cudnn'.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


def make_mesh(dp: int, tp: int, devices=None, *,
              explicit: bool = False) -> jax.sharding.Mesh:
  """A ``dp x tp`` mesh with Auto axes: jit's sharding propagation places
  what the model does not pin. (The block also runs on Explicit axes, the
  default of ``jax.make_mesh``.)"""
  devices = list(devices if devices is not None else jax.devices())[:dp * tp]
  if len(devices) < dp * tp:
    raise ValueError(f"{dp=} x {tp=} needs {dp * tp} devices, have {len(devices)}.")
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((dp, tp), (DP, TP), axis_types=(kind,) * 2,
                       devices=devices)


def parse_schedule(text: str | None) -> ficco_jax.Schedule | None:
  """``"default"``/None -> None (the library's heuristic); ``"none"`` -> no
  overlap; ``"dataflow:chunks[:comm[:compute]]"`` (``/`` also separates,
  ``c2`` also reads as 2), e.g. ``direct:2:xla``, ``ring:2:dma``."""
  if text is None or text in ("", "default"):
    return None
  if text == "none":
    return ficco_jax.Schedule(dataflow="none", num_chunks=1)
  parts = text.replace("/", ":").split(":")
  kw: dict[str, Any] = {"dataflow": parts[0]}
  if len(parts) > 1:
    kw["num_chunks"] = int(parts[1].lstrip("c"))
  for key, value in zip(("comm", "compute"), parts[2:]):
    kw[key] = value
  return ficco_jax.Schedule(**kw)


# ---------------------------------------------------------------- parameters


def param_specs(cfg: Config) -> dict[str, P]:
  """Every parameter is stacked over the layers (a leading axis, unsharded)."""
  del cfg
  return {
      "ln1": P(None),  # RMSNorm scales: tiny, replicated.
      # QKV columns are laid out [heads, 3, head_dim], so sharding the
      # columns over tp hands every device whole heads with their q, k, v.
      "wqkv": P(None, None, TP),
      # Rows [heads, head_dim]: the heads this device has.
      "wo": P(None, TP, None),
      "ln2": P(None),
      "w_up": P(None, None, TP),
      "w_down": P(None, TP, None),
  }


def init_params(key: jax.Array, cfg: Config, mesh: jax.sharding.Mesh) -> dict:
  """float32 parameters ``[layers, ...]``, created directly in their
  shardings (no host copy)."""
  d, f, n = cfg.d_model, cfg.d_ff, cfg.layers
  shapes = {"ln1": (n, d), "wqkv": (n, d, 3 * d), "wo": (n, d, d),
            "ln2": (n, d), "w_up": (n, d, f), "w_down": (n, f, d)}
  specs = param_specs(cfg)

  def init(key):
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    out = {}
    for name, shape in shapes.items():
      if len(shape) == 2:
        out[name] = jnp.ones(shape, jnp.float32)
      else:
        out[name] = (jax.random.normal(keys[name], shape, jnp.float32)
                     / np.sqrt(shape[1]))
    return out

  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  return jax.jit(init, out_shardings=shardings)(key)


# ---------------------------------------------------------------- the block


def _explicit(mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _constrain(a, mesh, spec):
  """Pins a layout: a hint on Auto axes, a real reshard on Explicit ones."""
  if _explicit(mesh):
    return jax.reshard(a, NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))


def _xla_matmul(a, w, mesh, out_spec):
  """``a @ w`` laid out as ``out_spec``; XLA inserts the collectives.

  Explicit axes want the output sharding up front (a sharded contraction is
  otherwise ambiguous); Auto axes take it as a constraint on the result.
  """
  if _explicit(mesh):
    return jnp.matmul(a, w, out_sharding=NamedSharding(mesh, out_spec))
  return _constrain(a @ w, mesh, out_spec)


def rms_norm(x, scale, eps=1e-6):
  # Over d_model, which every device holds whole: local, no communication.
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)


def causal_attention(q, k, v, implementation="xla"):
  """Softmax attention per head; ``[B, S, h, Dh]`` in and out.

  Heads are sharded over tp and the sequence is whole after the column-
  parallel QKV, so this is local to each device.
  """
  if implementation == "cudnn":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="cudnn")
  s = q.shape[1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                      preferred_element_type=jnp.float32)
  scores = scores / np.sqrt(q.shape[-1]).astype(np.float32)
  mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _column_parallel(x, w, *, mesh, use_ficco, schedule):
  """``[B, S/tp, D] @ [D, N/tp] -> [B, S, N/tp]``: gather the sequence."""
  if use_ficco:
    return ficco_jax.sharded.all_gather_matmul(
        x, w, mesh=mesh, axis_name=TP, gather_axis=1, x_spec=SEQ_PARALLEL,
        schedule=schedule)
  # Pin the gathered activation, so XLA all-gathers x (the Megatron-SP
  # layout) rather than picking another plan for the matmul.
  return _xla_matmul(_constrain(x, mesh, P(DP, None, None)), w, mesh,
                     COL_PARALLEL)


def _row_parallel(h, w, *, mesh, use_ficco, schedule):
  """``[B, S, F/tp] @ [F/tp, D] -> [B, S/tp, D]``: sum and scatter the sequence."""
  if use_ficco:
    return ficco_jax.sharded.matmul_reduce_scatter(
        h, w, mesh=mesh, axis_name=TP, scatter_axis=1, h_spec=COL_PARALLEL,
        schedule=schedule)
  return _xla_matmul(h, w, mesh, SEQ_PARALLEL)


def block_forward(params, x, *, cfg: Config, mesh, use_ficco: bool,
                  schedule: ficco_jax.Schedule | None = None):
  """One pre-norm transformer block.

  Args:
    params: one layer's parameters (`init_params`'s, indexed by layer).
    x: ``[B, S, D]`` in ``cfg.dtype``, sharded ``P("dp", "tp")``.
    cfg: sizes and compute dtype.
    mesh: the ``dp x tp`` mesh.
    use_ficco: the four tensor-parallel matmuls through ficco_jax (True) or
      as plain ``@`` with XLA's collectives (False).
    schedule: the ficco schedule for all four (None: the heuristic's).

  Returns:
    ``[B, S, D]``, sharded like ``x``.
  """
  mm = dict(mesh=mesh, use_ficco=use_ficco, schedule=schedule)
  w = {k: v.astype(cfg.dtype) for k, v in params.items()}  # Local casts.
  b, s, _ = x.shape
  x = _constrain(x, mesh, SEQ_PARALLEL)

  # Attention.
  qkv = _column_parallel(rms_norm(x, w["ln1"]), w["wqkv"], **mm)
  qkv = qkv.reshape(b, s, cfg.heads, 3, cfg.head_dim)
  # Each device has whole heads over the whole sequence, so attention needs
  # no communication; shard_map says so, where sharding propagation alone
  # is free to pick other layouts (it reshards the backward pass otherwise).
  heads = P(DP, None, TP)
  attn = jax.shard_map(
      lambda t: causal_attention(t[:, :, :, 0], t[:, :, :, 1], t[:, :, :, 2],
                                 cfg.attention),
      mesh=mesh, in_specs=heads, out_specs=heads)(_constrain(qkv, mesh, heads))
  attn = attn.reshape(b, s, cfg.d_model)
  x = x + _row_parallel(attn, w["wo"], **mm)

  # MLP.
  h = jax.nn.gelu(_column_parallel(rms_norm(x, w["ln2"]), w["w_up"], **mm))
  return x + _row_parallel(h, w["w_down"], **mm)


def model_forward(params, x, *, cfg: Config, mesh, use_ficco: bool,
                  schedule: ficco_jax.Schedule | None = None):
  """``cfg.layers`` blocks: `block_forward` under ``lax.scan`` over the
  stacked parameters (rematerialized in the backward pass with
  ``cfg.remat``); arguments as for `block_forward`."""
  def layer(x, p):
    return block_forward(p, x, cfg=cfg, mesh=mesh, use_ficco=use_ficco,
                         schedule=schedule), None
  if cfg.remat:
    layer = jax.checkpoint(layer)
  if cfg.layers == 1:
    # No loop: XLA drops a one-trip loop only when nothing in it has side
    # effects, and the copy engines' custom calls do, so a scan of one
    # would change ficco's program (not XLA's) from the single block's.
    return layer(x, jax.tree.map(lambda a: a[0], params))[0]
  x, _ = jax.lax.scan(layer, x, params)
  return x


def loss_fn(params, x, y, **kw):
  out = model_forward(params, x, **kw)
  return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))


def make_forward(cfg: Config, mesh, *, use_ficco: bool,
                 schedule: ficco_jax.Schedule | None = None):
  """The forward pass alone (prefill), jitted: ``(params, x, y) -> loss``
  (the loss so that both variants' results compare as one number)."""
  ps = {k: NamedSharding(mesh, s) for k, s in param_specs(cfg).items()}
  data_s = NamedSharding(mesh, SEQ_PARALLEL)
  fwd = lambda p, x, y: loss_fn(p, x, y, cfg=cfg, mesh=mesh,
                                use_ficco=use_ficco, schedule=schedule)
  return jax.jit(fwd, in_shardings=(ps, data_s, data_s),
                 out_shardings=NamedSharding(mesh, P()))


def flops_per_step(cfg: Config, batch: int, seq: int, *, train: bool) -> float:
  """Model flops of one step: the matmuls and causal attention, counted at
  half of the full ``S x S`` scores (FlashAttention's convention; the einsum
  attention computes them all); training is three times the forward pass,
  rematerialization not counted (MFU's convention)."""
  d, f = cfg.d_model, cfg.d_ff
  tokens = batch * seq
  proj = 2 * tokens * (3 * d * d + d * d + 2 * d * f)
  attn = 2 * batch * seq * seq * d  # QK^T and PV, causal: half of 2 x 2.
  fwd = cfg.layers * (proj + attn)
  return 3.0 * fwd if train else float(fwd)


# ---------------------------------------------------------------- training


def adam_init(params):
  # Two separate trees: the train step may donate both, and one buffer must
  # not be donated twice.
  zeros = lambda: jax.tree.map(jnp.zeros_like, params)
  return {"m": zeros(), "v": zeros(), "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, opt, *, lr, b1=0.9, b2=0.999, eps=1e-8):
  """Plain Adam; elementwise, so every moment stays in its parameter's sharding."""
  t = opt["t"] + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
  # Bias corrections in float32 (t is an int).
  c1 = 1 - b1 ** t.astype(jnp.float32)
  c2 = 1 - b2 ** t.astype(jnp.float32)
  params = jax.tree.map(
      lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps),
      params, m, v)
  return params, {"m": m, "v": v, "t": t}


def train_step(params, opt, x, y, *, cfg, mesh, use_ficco, schedule, lr):
  """Forward, backward and Adam update; returns ``(params, opt, loss)``."""
  loss, grads = jax.value_and_grad(loss_fn)(
      params, x, y, cfg=cfg, mesh=mesh, use_ficco=use_ficco, schedule=schedule)
  params, opt = adam_update(params, grads, opt, lr=lr)
  return params, opt, loss


def make_train_step(cfg: Config, mesh, *, use_ficco: bool,
                    schedule: ficco_jax.Schedule | None = None,
                    lr: float = 1e-3, donate: bool = False):
  """`train_step` jitted with the parameters' shardings pinned on the way out
  (so step n+1 sees the layouts step n saw) and, optionally, the parameters
  and optimizer state donated (the benchmark's memory-sane setting)."""
  ps = {k: NamedSharding(mesh, s) for k, s in param_specs(cfg).items()}
  opt_s = {"m": ps, "v": ps, "t": NamedSharding(mesh, P())}
  data_s = NamedSharding(mesh, SEQ_PARALLEL)
  step = lambda p, o, x, y: train_step(p, o, x, y, cfg=cfg, mesh=mesh,
                                       use_ficco=use_ficco, schedule=schedule,
                                       lr=lr)
  return jax.jit(step, in_shardings=(ps, opt_s, data_s, data_s),
                 out_shardings=(ps, opt_s, NamedSharding(mesh, P())),
                 donate_argnums=(0, 1) if donate else ())


def make_batch(key, cfg: Config, mesh, batch: int, seq: int):
  """Synthetic regression data ``(x, y)``, ``[B, S, D]``, sequence parallel."""
  s = NamedSharding(mesh, SEQ_PARALLEL)
  shape = (batch, seq, cfg.d_model)

  def gen(key):
    kx, ky = jax.random.split(key)
    return (jax.random.normal(kx, shape, jnp.float32).astype(cfg.dtype),
            jax.random.normal(ky, shape, jnp.float32).astype(cfg.dtype))

  return jax.jit(gen, out_shardings=(s, s))(key)


def train(cfg: Config, mesh, *, steps: int, batch: int, seq: int,
          use_ficco: bool, schedule=None, lr: float = 1e-3,
          seed: int = 0) -> list[float]:
  """Trains ``steps`` steps from a fixed seed; returns the losses."""
  params = init_params(jax.random.key(seed), cfg, mesh)
  opt = adam_init(params)
  step = make_train_step(cfg, mesh, use_ficco=use_ficco, schedule=schedule,
                         lr=lr)
  data_key = jax.random.key(seed + 1)
  losses = []
  for i in range(steps):
    x, y = make_batch(jax.random.fold_in(data_key, i), cfg, mesh, batch, seq)
    params, opt, loss = step(params, opt, x, y)
    losses.append(float(loss))
  return losses


def check_losses(losses, ref_losses, *, rtol: float) -> None:
  """Raises if any step's loss differs from the reference's by more than rtol."""
  for i, (a, r) in enumerate(zip(losses, ref_losses, strict=True)):
    if not np.isfinite(a) or abs(a - r) > rtol * abs(r):
      raise AssertionError(
          f"step {i}: ficco loss {a!r} vs reference {r!r} (rel"
          f" {abs(a - r) / abs(r):.2e} > {rtol=:.0e}).\nficco:    {losses}"
          f"\nreference: {ref_losses}")


def default_mesh_shape(dp: int | None, tp: int | None) -> tuple[int, int]:
  """CPU: 2x4 over the 8 virtual devices; GPU: 1 x all local GPUs."""
  n = len(jax.devices())
  if tp is None:
    tp = 4 if jax.default_backend() == "cpu" else n // (dp or 1)
  if dp is None:
    dp = max(1, n // tp)
  return dp, tp


def main(argv):
  del argv
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  # absl's app logs at INFO, which would print jax's probes of absent
  # backends ("Unable to initialize backend 'tpu'") as if they mattered.
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  dp, tp = default_mesh_shape(f.dp, f.tp)
  if f.heads % tp:
    raise app.UsageError(f"--heads={f.heads} must be divisible by the tensor-"
                         f"parallel size tp={tp} (each device takes whole"
                         " heads).")
  for name, size, by, what in (
      ("batch", f.batch, dp, "data-parallel size dp"),
      ("seq", f.seq, tp, "tensor-parallel size tp (sequence parallelism)"),
      ("d_ff", f.d_ff, tp, "tensor-parallel size tp")):
    if size % by:
      raise app.UsageError(f"--{name}={size} must be divisible by the {what}"
                           f"={by}.")
  mesh = make_mesh(dp, tp, explicit=f.explicit_axes)
  dtype = jnp.dtype(f.dtype)
  cfg = Config(d_model=f.d_model, heads=f.heads, d_ff=f.d_ff, dtype=dtype,
               layers=f.layers, remat=f.remat)
  schedule = parse_schedule(f.schedule)
  print(f"mesh dp={dp} x tp={tp} ({'Explicit' if f.explicit_axes else 'Auto'} axes) on {jax.devices()[0].device_kind};"
        f" {cfg}; batch={f.batch} seq={f.seq};"
        f" schedule={schedule.short() if schedule else 'default (heuristic)'}")
  common = dict(steps=f.steps, batch=f.batch, seq=f.seq, lr=f.lr)

  t0 = time.perf_counter()
  losses = train(cfg, mesh, use_ficco=True, schedule=schedule, **common)
  print(f"ficco     ({time.perf_counter() - t0:5.1f} s): "
        + " ".join(f"{l:.6f}" for l in losses))
  if not f.check:
    return
  t0 = time.perf_counter()
  ref = train(cfg, mesh, use_ficco=False, **common)
  print(f"reference ({time.perf_counter() - t0:5.1f} s): "
        + " ".join(f"{l:.6f}" for l in ref))
  # float32: both sum the same products, in different orders. bfloat16: the
  # activations are rounded at different points, so allow bf16's epsilon.
  if f.rtol is not None:
    rtol = f.rtol
  elif dtype == jnp.float64:
    rtol = 1e-10
  else:
    rtol = 1e-4 if dtype == jnp.float32 else 2e-2
  check_losses(losses, ref, rtol=rtol)
  worst = max(abs(a - r) / abs(r) for a, r in zip(losses, ref))
  print(f"losses match: max rel diff {worst:.2e} <= {rtol:.0e}")


def define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_integer("steps", 5, "Training steps.", lower_bound=1)
  flags.DEFINE_integer("layers", 1, "Transformer blocks (lax.scan over them).")
  flags.DEFINE_bool("remat", False, "Rematerialize each block's activations"
                    " in the backward pass.")
  flags.DEFINE_integer("batch", 4, "Global batch (divisible by dp).",
                       lower_bound=1)
  flags.DEFINE_integer("seq", 64, "Sequence length (divisible by tp x chunks).",
                       lower_bound=1)
  flags.DEFINE_integer("d_model", 64, "Model width.", lower_bound=1)
  flags.DEFINE_integer("heads", 8, "Attention heads (divisible by tp).",
                       lower_bound=1)
  flags.DEFINE_integer("d_ff", 256, "MLP width (divisible by tp).",
                       lower_bound=1)
  flags.DEFINE_string("dtype", "float32", "Compute dtype: float32 or bfloat16.")
  flags.DEFINE_string("schedule", "default",
                      "'default' (heuristic), 'none', or"
                      " 'dataflow:chunks[:comm[:compute]]', e.g. ring:2:dma.")
  flags.DEFINE_integer("dp", None, "Data-parallel size (default: see mesh).",
                       lower_bound=1)
  flags.DEFINE_integer("tp", None, "Tensor-parallel size (CPU 4, GPU all).",
                       lower_bound=1)
  flags.DEFINE_float("lr", 1e-3, "Adam learning rate.")
  flags.DEFINE_bool("explicit_axes", False, "Explicit mesh axes (sharding in"
                    " types) instead of Auto.")
  flags.DEFINE_bool("check", True, "Also train the XLA-collectives reference"
                    " and assert the losses match.")
  flags.DEFINE_float("rtol", None, "Loss tolerance (default 1e-10 f64, 1e-4"
                     " f32, 2e-2 bf16).")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  define_flags()
  app.run(main)
