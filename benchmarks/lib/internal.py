"""ficco_jax internals the tuning, kernel and characterization suites need
(the public API cannot fit a cost model, time one kernel, or copy bytes
without a matmul). The ops suite imports none of this: it runs against any
release with the public API.
"""

from __future__ import annotations

import importlib


def tuning(name: str):
  """``ficco_jax._src.tuning.<name>`` (cost_model, device_params,
  heuristics, autotune_cache)."""
  return importlib.import_module(f"ficco_jax._src.tuning.{name}")


def chunk_matmul():
  return importlib.import_module("ficco_jax._src.pallas.chunk_matmul")


def grouped_matmul():
  """The MoE ops' grouped matmul (`grouped_matmul.grouped_matmul`)."""
  return importlib.import_module("ficco_jax._src.pallas.grouped_matmul")


def dma_library():
  return importlib.import_module("ficco_jax._src.dma.library")


def gather():
  """The piecewise gather engine (`gather.run` / `gather.finish`)."""
  return importlib.import_module("ficco_jax._src.gather")


def plan():
  """Transfer plans (`plan.gather_plan`)."""
  return importlib.import_module("ficco_jax._src.plan")


def matmul():
  """A call's static config (`matmul.make_static`)."""
  return importlib.import_module("ficco_jax._src.matmul")
