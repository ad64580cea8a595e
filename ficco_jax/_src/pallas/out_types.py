"""Result types of the chunk-matmul kernels, typed for shard_map.

Inside shard_map with ``check_vma`` a kernel's result must say which mesh
axes it varies over (jax >= 0.10: ``manual_axis_type``; older: ``vma``):
the axes its operands vary over (`out_type`), or none, for a result that
later calls write into as a Ref (`invariant_out_type`). Both kernels build
their ``out_shape`` here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def out_type(shape, dtype, *, like) -> jax.ShapeDtypeStruct:
  """A result that varies over the mesh axes that any of ``like`` (the
  operands it is computed from) varies over."""
  # Note that jax 0.10.2's Pallas interpreter rejects even trivial kernels
  # under check_vma=True ("requires varying manual axes to match"), so
  # interpret mode inside shard_map needs check_vma=False; the Hopper kernel
  # does not.
  avals = [jax.typeof(a) for a in like]
  typed = [a for a in avals if getattr(a, "manual_axis_type", None) is not None]
  if typed:
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=typed[0].manual_axis_type)
  vma = frozenset().union(*(getattr(a, "vma", None) or () for a in avals))
  if vma:
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
  return jax.ShapeDtypeStruct(shape, dtype)


def invariant_out_type(shape, dtype) -> jax.ShapeDtypeStruct:
  """A result typed as varying over no mesh axis, explicitly (jax >= 0.11
  under check_vma demands a type): a fresh constant's type, in any jax."""
  mat = getattr(jax.typeof(jnp.zeros((), jnp.int32)), "manual_axis_type", None)
  if mat is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  return jax.ShapeDtypeStruct(shape, dtype)
