"""Global-array (pjit-style) forms of the collective matmuls.

Models that hold global arrays under ``jax.jit`` with a ``Mesh`` call these:
they wrap the per-shard ops in ``jax.shard_map`` over the whole mesh, so other
mesh axes (data parallelism) pass through untouched.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ficco_jax._src import devices
from ficco_jax._src import validation
from ficco_jax._src.ops.all_gather_matmul import api as ag_api
from ficco_jax._src.ops.matmul_reduce_scatter import api as rs_api


def _entries(spec: P | None, ndim: int, name: str) -> list[Any]:
  if spec is None:
    return [None] * ndim
  if not isinstance(spec, P):
    raise TypeError(f"{name} must be a PartitionSpec or None, got {spec!r}.")
  entries = list(spec) + [None] * (ndim - len(spec))
  if len(entries) != ndim:
    raise ValueError(f"{name}={spec} has more entries than the array's rank {ndim}.")
  return entries


def _uses(entry, axis_name) -> bool:
  return entry == axis_name or (isinstance(entry, tuple) and axis_name in entry)


def _check_mesh(mesh, axis_name, op):
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh, got {mesh!r}.")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{op}: axis_name {axis_name!r} is not an axis of the"
                     f" mesh (axes {mesh.axis_names}).")


def check_vma(mesh: jax.sharding.Mesh, schedule) -> bool:
  """The ``check_vma`` of the forms' own ``shard_map``: on, except where
  Pallas's interpreter runs (``compute="pallas"`` off GPUs), whose grid
  indices that check rejects (`pallas.portable`); the user cannot reach
  this ``shard_map`` to turn it off."""
  return not (getattr(schedule, "compute", None) == "pallas"
              and devices.mesh_platform(mesh) != "gpu")


def _place(a, mesh, spec):
  """Puts ``a`` in the layout shard_map expects, under jit or eagerly."""
  sharding = NamedSharding(mesh, spec)
  if isinstance(a, jax.core.Tracer):
    # Explicit mesh axes reject sharding constraints; they take a reshard.
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and explicit in getattr(mesh, "axis_types", ()):
      return jax.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)
  return jax.device_put(a, sharding)


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    gather_axis: int = 0,
    x_spec: P | None = None,
    **kwargs,
) -> jax.Array:
  """Column-parallel matmul of a row-sharded activation, on global arrays.

  Args:
    x: global ``[..., M, ..., K]``, sharded over ``axis_name`` along
      ``gather_axis`` (and however ``x_spec`` says along other axes).
    w: global ``[K, N]``, columns sharded over ``axis_name``.
    mesh: the mesh; ``axis_name`` is the tensor-parallel axis.
    axis_name: the axis to gather over.
    gather_axis: the axis of ``x`` sharded over ``axis_name``.
    x_spec: ``x``'s full PartitionSpec; default shards only ``gather_axis``
      over ``axis_name``. Entries for other mesh axes (e.g. a batch axis
      over ``"dp"``) pass through to the result.
    **kwargs: ``schedule``, ``precision``, ``preferred_element_type``,
      ``timeout_s`` as for `ficco_jax.all_gather_matmul`.

  Returns:
    Global ``[..., M, ..., N]``: replicated over ``axis_name`` along
    ``gather_axis``, columns sharded over ``axis_name``.
  """
  op = "all_gather_matmul"
  _check_mesh(mesh, axis_name, op)
  validation.check_array("x", x)
  axis = validation.normalize_axis("gather_axis", gather_axis, x.ndim, x.shape)
  entries = _entries(x_spec, x.ndim, "x_spec")
  if x_spec is None:
    entries[axis] = axis_name
  elif entries[axis] != axis_name:
    raise ValueError(f"x_spec={x_spec} must shard gather_axis={axis} over"
                     f" exactly {axis_name!r}.")
  if any(_uses(e, axis_name) for i, e in enumerate(entries) if i != axis):
    raise ValueError(f"x_spec={x_spec} may use {axis_name!r} only at gather_axis.")
  out_entries = list(entries)
  out_entries[axis] = None
  out_entries[-1] = axis_name
  x_spec, w_spec, out_spec = P(*entries), P(None, axis_name), P(*out_entries)

  def body(xl, wl):
    return ag_api.all_gather_matmul(xl, wl, axis_name=axis_name,
                                    gather_axis=axis, **kwargs)

  f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                    out_specs=out_spec,
                    check_vma=check_vma(mesh, kwargs.get("schedule")))
  return f(_place(x, mesh, x_spec), _place(w, mesh, w_spec))


def matmul_reduce_scatter(
    h: jax.Array,
    w: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    scatter_axis: int = 0,
    h_spec: P | None = None,
    **kwargs,
) -> jax.Array:
  """Row-parallel matmul whose sum is scattered over rows, on global arrays.

  Args:
    h: global ``[..., M, ..., F]``, the contraction (last axis) sharded over
      ``axis_name``.
    w: global ``[F, N]``, rows sharded over ``axis_name``.
    mesh: the mesh.
    axis_name: the tensor-parallel axis.
    scatter_axis: the axis of the result sharded over ``axis_name``.
    h_spec: ``h``'s full PartitionSpec; default shards only the last axis
      over ``axis_name``. Other mesh axes pass through.
    **kwargs: as for `ficco_jax.matmul_reduce_scatter`.

  Returns:
    Global ``[..., M, ..., N]`` sharded over ``axis_name`` along
    ``scatter_axis``.
  """
  op = "matmul_reduce_scatter"
  _check_mesh(mesh, axis_name, op)
  validation.check_array("h", h)
  axis = validation.normalize_axis("scatter_axis", scatter_axis, h.ndim, h.shape)
  entries = _entries(h_spec, h.ndim, "h_spec")
  if h_spec is None:
    entries[-1] = axis_name
  elif entries[-1] != axis_name:
    raise ValueError(f"h_spec={h_spec} must shard the last axis over exactly"
                     f" {axis_name!r}.")
  if any(_uses(e, axis_name) for e in entries[:-1]):
    raise ValueError(f"h_spec={h_spec} may use {axis_name!r} only on the last axis.")
  if entries[axis] is not None:
    raise ValueError(f"h_spec={h_spec} must leave scatter_axis={axis} unsharded.")
  # Here, where h's global shape is known (the per-shard op sees its shard).
  validation.check_divisible(
      f"h.shape[{axis}] (h is {tuple(h.shape)}, the rows scattered)",
      h.shape[axis], mesh.shape[axis_name], f"the size of axis {axis_name!r}")
  out_entries = list(entries)
  out_entries[-1] = None
  out_entries[axis] = axis_name
  h_spec, w_spec, out_spec = P(*entries), P(axis_name, None), P(*out_entries)

  def body(hl, wl):
    return rs_api.matmul_reduce_scatter(hl, wl, axis_name=axis_name,
                                        scatter_axis=axis, **kwargs)

  f = jax.shard_map(body, mesh=mesh, in_specs=(h_spec, w_spec),
                    out_specs=out_spec,
                    check_vma=check_vma(mesh, kwargs.get("schedule")))
  return f(_place(h, mesh, h_spec), _place(w, mesh, w_spec))
