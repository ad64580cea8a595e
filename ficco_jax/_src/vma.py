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
  missing = varying_axes(like) - varying_axes(ct)
  if missing:
    ct = lax.pcast(ct, tuple(sorted(missing)), to="varying")
  return ct
