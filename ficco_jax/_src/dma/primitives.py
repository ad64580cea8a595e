"""What every copy-engine primitive shares: how it is made and lowered."""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.interpreters import batching
from jax.interpreters import mlir

from ficco_jax._src.dma import library

VMAP_UNSUPPORTED = (
    "comm='dma' does not support jax.vmap: its copy-engine calls move whole"
    " buffers between devices, one op per call. Fold the batch into the"
    " operand's rows instead (the ops take any rank >= 2, e.g. x [B, m, K]"
    " with gather_axis=1), or use Schedule(comm='xla').")


def _no_batching(*args, **kwargs):
  del args, kwargs
  raise NotImplementedError(VMAP_UNSUPPORTED)


def primitive(name: str, *, multiple_results: bool = True) -> Primitive:
  """A primitive of the copy-engine protocol, whose batching rule says why
  it has none (instead of jax's generic error)."""
  p = Primitive(name)
  p.multiple_results = multiple_results
  batching.primitive_batchers[p] = _no_batching
  return p


def timeout_ms(timeout_s: float) -> int:
  """A wait bound as the handlers take it: whole milliseconds, at least 1."""
  if not timeout_s > 0:
    raise ValueError(f"{timeout_s=} must be > 0.")
  return max(1, int(round(timeout_s * 1000)))


def concrete_mesh(ctx: mlir.LoweringRuleContext, axis_name: str):
  """The physical mesh the program is lowered for.

  The copies need device ordinals, but inside shard_map the jaxpr only knows
  axis names and sizes: the concrete mesh is visible solely to the lowering,
  as the module's SPMD axis context (jit + shard_map over a jax.sharding.Mesh).
  """
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(
        "comm='dma' must be lowered inside jit(shard_map(...)) over a concrete"
        f" jax.sharding.Mesh (got {type(mesh).__name__}); use comm='xla'.")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{axis_name=} is not an axis of {mesh.axis_names}.")
  return mesh


def platform_of(ctx) -> int:
  """The handlers' platform id (`library.platform_id`) of a lowering."""
  platforms = ctx.module_context.platforms
  if len(platforms) != 1:
    raise ValueError(f"comm='dma' lowers for one platform, got {platforms}.")
  return library.platform_id(platforms[0])


def program_state(ctx, key: tuple) -> dict:
  """State that lives exactly as long as the program being lowered: a dict
  in JAX's per-module lowering cache (shared by every ``replace`` copy of
  the module's context, gone with the module), one per ``key``."""
  return ctx.module_context.cached_primitive_lowerings.setdefault(key, {})


def program_name(ctx) -> str:
  """The name of the program being lowered (its module, e.g. "jit_layer"),
  for the handlers' messages: a timeout names the program of the stalled op
  and of the op each missing device waits in instead."""
  attrs = ctx.module_context.module.operation.attributes
  if "sym_name" not in attrs:
    return "<unnamed program>"
  return ir.StringAttr(attrs["sym_name"]).value
