"""ficco_jax internals the tuning and kernel suites need (the public API
cannot fit a cost model or time one kernel).

The tuning modules live in ``ficco_jax._src.tuning``; an installed package
that predates that layout has them directly under ``ficco_jax._src``, so each
import falls back to the old path. The ops suite imports none of this: it
runs against any release with the public API.
"""

from __future__ import annotations

import importlib


def _first(*paths: str):
  errors = []
  for path in paths:
    try:
      return importlib.import_module(path)
    except ImportError as e:
      errors.append(f"{path}: {e}")
  raise ImportError("; ".join(errors))


def tuning(name: str):
  """``ficco_jax._src.tuning.<name>`` (cost_model, device_params,
  heuristics, autotune_cache)."""
  return _first(f"ficco_jax._src.tuning.{name}", f"ficco_jax._src.{name}")


def chunk_matmul():
  return _first("ficco_jax._src.pallas.chunk_matmul")


def dma_library():
  return _first("ficco_jax._src.dma.library")
