"""Global-array (pjit-style) forms of the MoE ops: shard_map over the
expert axis, every operand sharded along its first axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ficco_jax._src import sharded as sharded_lib
from ficco_jax._src.ops.moe import api


def _call(op, fn, a_name, a, w, group_sizes, mesh, axis_name, **kwargs):
  sharded_lib._check_mesh(mesh, axis_name, op)  # pylint: disable=protected-access
  p = mesh.shape[axis_name]
  # The global shapes, checked here: past this point the per-shard op (or
  # jax's sharding) would name only a shard's shape.
  shape = lambda v: tuple(getattr(v, "shape", ()))
  if len(shape(a)) != 2 or shape(a)[0] % p:
    raise ValueError(
        f"{op}: {a_name} must be global [rows, d] with rows a multiple of"
        f" the {p} devices of {axis_name!r}, got shape {shape(a)}.")
  if len(shape(w)) != 3 or shape(w)[0] % p:
    raise ValueError(
        f"{op}: w must be global [experts, d, f] with experts a multiple of"
        f" the {p} devices of {axis_name!r}, got shape {shape(w)}.")
  gs_dtype = getattr(group_sizes, "dtype", None)
  if gs_dtype is None or not jnp.issubdtype(gs_dtype, jnp.integer):
    raise TypeError(
        f"{op}: group_sizes must be an integer [{p}, experts] array (a row"
        f" of counts per device of {axis_name!r}), got"
        f" {type(group_sizes).__name__}"
        + (f" of {gs_dtype} {shape(group_sizes)}" if gs_dtype else "")
        + ": pass a jax or numpy integer array.")
  if getattr(group_sizes, "ndim", None) != 2 or group_sizes.shape[0] != p:
    raise ValueError(
        f"{op}: group_sizes must be [{p}, experts] (a row of counts per"
        f" device of {axis_name!r}), got shape"
        f" {tuple(getattr(group_sizes, 'shape', ()))}.")
  spec = P(axis_name)

  def body(al, wl, gl):
    return fn(al, wl, gl[0], axis_name=axis_name, **kwargs)

  f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                    out_specs=spec,
                    check_vma=sharded_lib.check_vma(mesh,
                                                    kwargs.get("schedule")))
  place = lambda x: sharded_lib._place(x, mesh, spec)  # pylint: disable=protected-access
  return f(place(a), place(w), place(group_sizes))


def all_to_all_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                      mesh: jax.sharding.Mesh, axis_name: str,
                      **kwargs) -> jax.Array:
  """`ficco_jax.all_to_all_matmul` on global arrays.

  Args:
    x: global ``[P * T, d]``, rows sharded over ``axis_name`` (each
      device's T rows sorted by expert).
    w: global ``[P * E_l, d, f]``, experts sharded over ``axis_name``.
    group_sizes: ``[P, P * E_l]`` int, device r's counts in row r.
    mesh: the mesh; other axes than ``axis_name`` are not used.
    axis_name: the expert-parallel axis.
    **kwargs: ``capacity``, ``piece_capacity``, ``schedule``,
      ``precision``, ``preferred_element_type``, ``check_routing``,
      ``timeout_s`` as for the per-shard op.

  Returns:
    Global ``[P * capacity, f]``: each device's received rows, sharded.
  """
  return _call("all_to_all_matmul", api.all_to_all_matmul, "x", x, w,
               group_sizes, mesh, axis_name, **kwargs)


def matmul_all_to_all(h: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                      mesh: jax.sharding.Mesh, axis_name: str,
                      **kwargs) -> jax.Array:
  """`ficco_jax.matmul_all_to_all` on global arrays.

  Args:
    h: global ``[P * C, d]``, `all_to_all_matmul`'s sharded layout.
    w: global ``[P * E_l, d, f]``, experts sharded over ``axis_name``.
    group_sizes: ``[P, P * E_l]`` int, as for the dispatch.
    mesh: the mesh.
    axis_name: the expert-parallel axis.
    **kwargs: ``num_tokens`` (required: the token rows per device,
      ``T``, not the global rows), ``piece_capacity``,
      ``schedule``, ``precision``, ``preferred_element_type``,
      ``check_routing``, ``timeout_s``.

  Returns:
    Global ``[P * T, f]``: every token row's product, sharded like ``x``.
  """
  return _call("matmul_all_to_all", api.matmul_all_to_all, "h", h, w,
               group_sizes, mesh, axis_name, **kwargs)
