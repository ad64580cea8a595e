"""Argument checks shared by every op: clear errors that name the argument."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import numpy as np

_SUPPORTED_DTYPES = (
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
  if np.dtype(a.dtype) not in _SUPPORTED_DTYPES:
    raise TypeError(
        f"{name} has dtype {a.dtype}; supported dtypes are float16, bfloat16,"
        " float32 and float64."
    )


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
