"""A mixture-of-experts layer on ficco_jax's MoE ops, trained against a
reference built from jax's ragged ops.

Router (top-k of a softmax over experts), dispatch (`all_to_all_matmul`:
token rows to the devices that own their experts, through the first expert
matmul), the activation, combine (`matmul_all_to_all`: through the second
expert matmul and back to the tokens), and the gate-weighted sum over the
k choices. The reference runs the same layer with every expert's weights on
every device and `lax.ragged_dot` alone (no exchange); both train with SGD
from one seed and their losses must agree.

Runs on the local GPUs when there are at least two, else on 8 virtual CPU
devices:

  python examples/moe_layer.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:  # Keep the user's.
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import jax  # pylint: disable=g-import-not-at-top
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule


@dataclasses.dataclass(frozen=True)
class Config:
  d_model: int = 48
  d_ff: int = 40
  experts: int = 16      # a multiple of the expert-parallel axis size
  top_k: int = 2
  tokens: int = 24       # per device
  capacity_factor: float = 2.0
  dtype: object = np.float32


def init_params(key, cfg: Config, mesh):
  kr, k1, k2 = jax.random.split(key, 3)
  scale = lambda fan_in: 1.0 / np.sqrt(fan_in)
  params = {
      "router": jax.random.normal(kr, (cfg.d_model, cfg.experts)) *
                scale(cfg.d_model),
      "w_in": jax.random.normal(k1, (cfg.experts, cfg.d_model, cfg.d_ff)) *
              scale(cfg.d_model),
      "w_out": jax.random.normal(k2, (cfg.experts, cfg.d_ff, cfg.d_model)) *
               scale(cfg.d_ff),
  }
  specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}
  return {k: jax.device_put(v.astype(cfg.dtype), NamedSharding(mesh, specs[k]))
          for k, v in params.items()}


def make_batch(key, cfg: Config, mesh):
  p = mesh.devices.size
  kx, ky = jax.random.split(key)
  shape = (p * cfg.tokens, cfg.d_model)
  put = lambda a: jax.device_put(a.astype(cfg.dtype),
                                 NamedSharding(mesh, P("ep")))
  return put(jax.random.normal(kx, shape)), put(jax.random.normal(ky, shape))


def _route(x, router, cfg: Config):
  """Top-k routing of one device's tokens, sorted by expert: the token of
  each sorted row, its gate weight, and the rows per expert."""
  probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
  gate, expert = lax.top_k(probs, cfg.top_k)                 # [T, k]
  expert, gate = expert.reshape(-1), gate.reshape(-1)
  order = jnp.argsort(expert, stable=True)
  token = order // cfg.top_k
  sizes = jnp.bincount(expert, length=cfg.experts).astype(jnp.int32)
  return token, gate[order], sizes


def _combine_tokens(y_rows, token, gate, cfg: Config):
  y = jnp.zeros((cfg.tokens, y_rows.shape[-1]), jnp.float32)
  return y.at[token].add(y_rows.astype(jnp.float32) * gate[:, None])


def make_loss(cfg: Config, mesh, *, use_ficco: bool, schedule=None):
  """The layer's mean squared error against the targets, on global arrays."""
  rows = cfg.tokens * cfg.top_k
  # Rows a device may receive. Routing past it is an error of the step
  # (check_routing), never dropped tokens: a router that collapses onto
  # one device's experts stops training with a message naming it.
  capacity = int(np.ceil(cfg.capacity_factor * rows))

  def ficco_layer(x, router, w_in, w_out):
    token, gate, sizes = _route(x, router, cfg)
    h = ficco_jax.all_to_all_matmul(x[token], w_in, sizes, axis_name="ep",
                                    capacity=capacity, schedule=schedule)
    h = jax.nn.gelu(h).astype(x.dtype)
    y = ficco_jax.matmul_all_to_all(h, w_out, sizes, axis_name="ep",
                                    num_tokens=rows, schedule=schedule)
    return _combine_tokens(y, token, gate, cfg)

  def reference_layer(x, router, w_in, w_out):
    # Every expert here: gather the expert-sharded weights, then ragged_dot.
    w_in = lax.all_gather(w_in, "ep", tiled=True)
    w_out = lax.all_gather(w_out, "ep", tiled=True)
    token, gate, sizes = _route(x, router, cfg)
    h = jax.nn.gelu(lax.ragged_dot(x[token], w_in, sizes)).astype(x.dtype)
    return _combine_tokens(lax.ragged_dot(h, w_out, sizes), token, gate, cfg)

  layer = ficco_layer if use_ficco else reference_layer

  def local_loss(x, y, router, w_in, w_out):
    err = layer(x, router, w_in, w_out) - y.astype(jnp.float32)
    return lax.pmean(jnp.mean(err * err), "ep")

  f = jax.shard_map(local_loss, mesh=mesh,
                    in_specs=(P("ep"), P("ep"), P(), P("ep"), P("ep")),
                    out_specs=P())
  return lambda params, x, y: f(x, y, params["router"], params["w_in"],
                                params["w_out"])


def make_train_step(cfg: Config, mesh, *, use_ficco: bool, schedule=None,
                    lr: float = 0.1):
  loss_fn = make_loss(cfg, mesh, use_ficco=use_ficco, schedule=schedule)

  @jax.jit
  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree.map(lambda w, g: (w - lr * g).astype(w.dtype), params,
                          grads)
    return params, loss
  return step


def train(cfg: Config, mesh, *, use_ficco: bool, steps: int = 3,
          schedule=None) -> list[float]:
  params = init_params(jax.random.key(0), cfg, mesh)
  step = make_train_step(cfg, mesh, use_ficco=use_ficco, schedule=schedule)
  x, y = make_batch(jax.random.key(100), cfg, mesh)  # One batch: it fits.
  losses = []
  for _ in range(steps):
    params, loss = step(params, x, y)
    losses.append(float(loss))
  return losses


def main() -> int:
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  devices = gpus if len(gpus) >= 2 else jax.devices("cpu")
  mesh = jax.make_mesh((len(devices),), ("ep",), devices=devices)
  cfg = Config(experts=2 * len(devices))
  ref = train(cfg, mesh, use_ficco=False)
  print(f"reference (ragged_dot, every expert local): {ref}")
  worst = 0.0
  for sched in (None, Schedule(dataflow="direct")):
    got = train(cfg, mesh, use_ficco=True, schedule=sched)
    err = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    worst = max(worst, err)
    print(f"ficco schedule={sched.short() if sched else None}: {got}"
          f" (max relative difference {err:.1e})")
  ok = worst < (1e-4 if devices[0].platform == "cpu" else 3e-3)
  print("losses agree" if ok else "LOSSES DIFFER")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
