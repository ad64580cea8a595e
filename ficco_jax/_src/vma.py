"""Varying-manual-axes bookkeeping for custom VJPs inside shard_map.

With ``check_vma`` (shard_map's default) every value records the mesh axes it
varies over. A weight replicated over "dp" but multiplied by a dp-sharded
activation was implicitly broadcast in the forward pass; plain autodiff
transposes that broadcast into a psum over "dp". A custom VJP has to do the
same by hand, or its cotangent would have the wrong type (and be wrong).
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):  # jax >= 0.10
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", frozenset()))  # older jax


def match(ct: jax.Array, like: jax.Array) -> jax.Array:
  """Gives the cotangent ``ct`` the varying axes of its primal ``like``."""
  extra = varying_axes(ct) - varying_axes(like)
  if extra:
    ct = lax.psum(ct, tuple(sorted(extra)))
  return vary_like(ct, like)


def vary_like(y: jax.Array, *likes: jax.Array) -> jax.Array:
  """``y`` typed as varying over every axis any of ``likes`` varies over.

  For results of ficco's Pallas kernel written in place: jax >= 0.11's
  ``pl.kernel`` takes no Ref that varies over a manual axis, so an output
  written into is typed invariant, although its rows differ per device. A
  ``psum`` of an invariant value multiplies it by the axis size instead of
  summing, so the op restores the type before returning (no run-time cost).
  """
  want = frozenset().union(*(varying_axes(a) for a in likes))
  missing = want - varying_axes(y)
  if missing:
    y = lax.pcast(y, tuple(sorted(missing)), to="varying")
  return y
