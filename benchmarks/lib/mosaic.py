"""JAX's own Mosaic GPU collective matmul, the all-gather's JAX peer.

``jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul``
runs on Hopper GPUs only, over the whole mesh (its axis size must equal
``jax.device_count()``), in bf16. A config is ``tile_m x tile_n x tile_k x
max_concurrent_steps``; the suite times a small tile search.
"""

from __future__ import annotations

import functools
import inspect


def unsupported(axis_size: int) -> str | None:
  """Why the kernel cannot run here, or None."""
  import jax
  platform = jax.devices()[0].platform
  if platform != "gpu":
    return f"needs a Hopper GPU (platform is {platform})"
  if axis_size != jax.device_count():
    return (f"whole mesh only: the kernel needs axis size =="
            f" jax.device_count() ({axis_size} != {jax.device_count()})")
  return None


def kernel(config: str):
  """``all_gather_lhs_matmul`` with one tile config, for the jax versions
  that take a ``TuningConfig`` and the older ones that take block sizes."""
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
  tm, tn, tk, steps = (int(v) for v in config.lower().split("x"))
  params = inspect.signature(cm.all_gather_lhs_matmul).parameters
  if "config" in params:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    kw = {"config": hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk,
                                    max_concurrent_steps=steps)}
  else:
    kw = {"block_m": tm, "block_n": tn, "block_k": tk,
          "max_concurrent_steps": steps}
    if "sm_n_tile" in params:
      kw["sm_n_tile"] = 1
  return functools.partial(cm.all_gather_lhs_matmul, axis_name="x",
                           dtype=jnp.bfloat16, **kw)
