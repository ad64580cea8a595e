"""Global-array (pjit-style) forms of the collective matmuls.

Models that hold global arrays under ``jax.jit`` with a ``Mesh`` call these:
they wrap the per-shard ops in ``jax.shard_map`` over the whole mesh, so other
mesh axes (data parallelism) pass through untouched.
"""

from __future__ import annotations

import math
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


def _ways(mesh: jax.sharding.Mesh, entry, spec_name: str, spec) -> int:
  """Devices one PartitionSpec entry splits a dimension over."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  unknown = [n for n in names if n not in mesh.shape]
  if unknown:
    raise ValueError(f"{spec_name}={spec} names {unknown}, not axes of the"
                     f" mesh (axes {mesh.axis_names}).")
  return math.prod(mesh.shape[n] for n in names)


def specs(op: str, a: jax.Array, w: jax.Array, *, mesh: jax.sharding.Mesh,
          axis_name: str, axis: int, spec: P | None):
  """Checks a sharded form's global arguments; returns ``(axis, a_spec,
  w_spec, out_spec)``: the row axis normalized, and the specs of its
  ``shard_map``.

  Here, where the global shapes are known, so that an error names the
  arrays the caller passed (the per-shard op sees only its shard).

  Args:
    op: ``"all_gather_matmul"`` (``a`` is ``x``) or
      ``"matmul_reduce_scatter"`` (``a`` is ``h``).
    a, w, mesh, axis_name: the form's arguments.
    axis: ``gather_axis`` / ``scatter_axis``.
    spec: ``x_spec`` / ``h_spec``.
  """
  gather = op == "all_gather_matmul"
  a_name, axis_arg = ("x", "gather_axis") if gather else ("h", "scatter_axis")
  spec_name = f"{a_name}_spec"
  _check_mesh(mesh, axis_name, op)
  validation.check_array(a_name, a)
  validation.check_weight(
      "w", w, a.shape[-1], f"{a_name}.shape[-1] of {a_name} {tuple(a.shape)}")
  axis = validation.normalize_axis(axis_arg, axis, a.ndim, a.shape)
  entries = _entries(spec, a.ndim, spec_name)
  if gather:
    if spec is None:
      entries[axis] = axis_name
    elif entries[axis] != axis_name:
      raise ValueError(f"x_spec={spec} must shard gather_axis={axis} over"
                       f" exactly {axis_name!r}.")
    if any(_uses(e, axis_name) for i, e in enumerate(entries) if i != axis):
      raise ValueError(
          f"x_spec={spec} may use {axis_name!r} only at gather_axis.")
  else:
    if spec is None:
      entries[-1] = axis_name
    elif entries[-1] != axis_name:
      raise ValueError(f"h_spec={spec} must shard the last axis over exactly"
                       f" {axis_name!r}.")
    if any(_uses(e, axis_name) for e in entries[:-1]):
      raise ValueError(
          f"h_spec={spec} may use {axis_name!r} only on the last axis.")
    if entries[axis] is not None:
      raise ValueError(
          f"h_spec={spec} must leave scatter_axis={axis} unsharded.")
    validation.check_divisible(
        f"h.shape[{axis}] (h is {tuple(a.shape)}, the rows scattered)",
        a.shape[axis], mesh.shape[axis_name], f"the size of axis {axis_name!r}")
  a_spec = P(*entries)
  for i, e in enumerate(entries):
    validation.check_divisible(
        f"{a_name}.shape[{i}] ({a_name} is {tuple(a.shape)}, split over"
        f" {e!r} by {spec_name}={a_spec})", a.shape[i],
        _ways(mesh, e, spec_name, a_spec), f"the devices along {e!r}")
  w_spec = P(None, axis_name) if gather else P(axis_name, None)
  if gather:
    validation.check_divisible(
        f"w.shape[1] (w is {tuple(w.shape)}, its columns split over"
        f" {axis_name!r})", w.shape[1], mesh.shape[axis_name],
        f"the size of axis {axis_name!r}")
  out_entries = list(entries)
  if gather:
    out_entries[axis], out_entries[-1] = None, axis_name
  else:
    out_entries[-1], out_entries[axis] = None, axis_name
  return axis, a_spec, w_spec, P(*out_entries)


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
  axis, x_spec, w_spec, out_spec = specs(
      "all_gather_matmul", x, w, mesh=mesh, axis_name=axis_name,
      axis=gather_axis, spec=x_spec)

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
  axis, h_spec, w_spec, out_spec = specs(
      "matmul_reduce_scatter", h, w, mesh=mesh, axis_name=axis_name,
      axis=scatter_axis, spec=h_spec)

  def body(hl, wl):
    return rs_api.matmul_reduce_scatter(hl, wl, axis_name=axis_name,
                                        scatter_axis=axis, **kwargs)

  f = jax.shard_map(body, mesh=mesh, in_specs=(h_spec, w_spec),
                    out_specs=out_spec,
                    check_vma=check_vma(mesh, kwargs.get("schedule")))
  return f(_place(h, mesh, h_spec), _place(w, mesh, w_spec))
