"""Argument checks shared by every op: clear errors that name the argument."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
from jax import lax
import numpy as np

SUPPORTED_DTYPES = (
    np.dtype("float16"),
    np.dtype(jax.numpy.bfloat16),
    np.dtype("float32"),
    np.dtype("float64"),
)


def check_array(name: str, a: Any, *, min_rank: int = 2) -> None:
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(a).__name__}.")
  if a.ndim < min_rank:
    raise ValueError(
        f"{name} must have rank >= {min_rank}, got shape {tuple(a.shape)}."
    )
  if np.dtype(a.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{name} has dtype {a.dtype}; supported dtypes are float16, bfloat16,"
        " float32 and float64."
    )


# The longest wait for peers a copy-engine op takes (a week): the handlers
# count it in int64 milliseconds, and anything longer is a hang by another
# name.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(timeout_s: Any) -> float:
  """``timeout_s`` as a float, or a TypeError/ValueError naming it."""
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
    raise TypeError(f"timeout_s must be a number of seconds, got"
                    f" {timeout_s!r} ({type(timeout_s).__name__}).")
  t = float(timeout_s)
  if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S):
    raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of"
                     f" seconds in (0, {MAX_TIMEOUT_S:g}].")
  return t


def check_nonempty(name: str, a: Any) -> None:
  """No zero-size dimension: there would be nothing to split or contract."""
  if any(int(d) == 0 for d in a.shape):
    raise ValueError(f"{name} has shape {tuple(a.shape)}: every dimension"
                     " must be at least 1.")


# The operand tracers of a call that is not traced into one compiled
# program (`operand_kind`): eager shard_map runs each primitive alone, and
# jax.vmap's batch rule would run the copies once per example.
NOT_ONE_PROGRAM = ("ShardMapTracer", "BatchTracer")


def operand_kind(a: Any) -> str:
  """How an operand is being traced, by its tracers' type names:
  ``"BatchTracer"`` under ``jax.vmap``, else ``"ShardMapTracer"`` in an
  eager ``shard_map``, else the outermost type's name.

  Every tracer an autodiff transformation wraps around the operand is looked
  through (``jax.grad`` of an eager ``shard_map``, ``jax.vmap`` of a
  ``jax.grad``): the outermost alone would hide the ones that matter. A
  tracer of ``jax.jit`` (or any staging trace) wraps nothing, so a ``vmap``
  or an eager ``shard_map`` outside the ``jit`` does not count.
  """
  kinds, v = [], a
  while isinstance(v, jax.core.Tracer) and len(kinds) < 64:
    kinds.append(type(v).__name__)
    # JVP and linearize tracers hold their primal, batch and shard_map
    # tracers their value.
    v = getattr(v, "primal", getattr(v, "val", None))
  for kind in ("BatchTracer", "ShardMapTracer"):
    if kind in kinds:
      return kind
  return kinds[0] if kinds else type(a).__name__


def check_traced_for_copy_engines(op_name: str, a: Any) -> None:
  """``comm="dma"`` needs the whole op in one compiled program.

  Eager ``shard_map`` runs each primitive as a program of its own, so a
  copy-engine start and the wait and done that pair with it would never
  meet. The operand's tracers say how the op is being run (`operand_kind`).
  """
  check_program_kind(op_name, operand_kind(a))


def check_program_kind(op_name: str, kind: str | None) -> None:
  """`check_traced_for_copy_engines` for an operand of type name ``kind``
  (None: traced under ``jax.jit``)."""
  if kind == "ShardMapTracer":
    raise ValueError(
        f"{op_name} with comm='dma' must be traced under jax.jit: eager"
        " shard_map runs each step as its own program, and the copy-engine"
        " protocol needs them in one. Wrap the shard_map (or the"
        " ficco_jax.sharded call) in jax.jit, or use Schedule(comm='xla').")
  if kind == "BatchTracer":
    from ficco_jax._src.dma import primitives  # pylint: disable=g-import-not-at-top
    raise NotImplementedError(primitives.VMAP_UNSUPPORTED)


def check_weight(name: str, w: Any, k: int, k_name: str) -> None:
  check_array(name, w)
  if w.ndim != 2:
    raise ValueError(f"{name} must be a matrix [K, n], got shape {tuple(w.shape)}.")
  if w.shape[0] != k:
    raise ValueError(
        f"{name} has shape {tuple(w.shape)}: its first dimension must equal"
        f" the contraction size {k} ({k_name})."
    )


def normalize_axis(name: str, axis: int, ndim: int, shape) -> int:
  """Normalizes a row axis: any axis but the last (the contraction)."""
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {axis!r}.")
  a = int(axis) + ndim if axis < 0 else int(axis)
  if not 0 <= a < ndim - 1:
    raise ValueError(
        f"{name}={axis} is invalid for an operand of shape {tuple(shape)}: it"
        f" must name one of its first {ndim - 1} axes (the last axis is the"
        " contraction)."
    )
  return a


def axis_size(axis_name: Any, op_name: str) -> int:
  """Size of a shard_map axis, or a ValueError that explains how to call."""
  if not isinstance(axis_name, str):
    raise TypeError(
        f"{op_name}: axis_name must be a mesh axis name (str), got {axis_name!r}."
    )
  try:
    return int(lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(
        f"{op_name}: axis {axis_name!r} is not bound. Call {op_name} inside"
        f" jax.shard_map over a mesh with axis {axis_name!r} (x and w are then"
        " the per-device shards), or use ficco_jax.sharded."
        f"{op_name}(..., mesh=mesh, axis_name={axis_name!r}) on global arrays."
    ) from e


def check_divisible(what: str, size: int, by: int, by_what: str) -> None:
  if size % by:
    raise ValueError(f"{what} ({size}) must be divisible by {by_what} ({by}).")
