"""Shared test helpers: device meshes, random data, float64 references."""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np
import pytest


def test_devices():
  """The devices tests run on: local GPUs if there are >= 2, else CPUs."""
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  return gpus if len(gpus) >= 2 else jax.devices("cpu")


def on_gpu() -> bool:
  return test_devices()[0].platform == "gpu"


def mesh(shape, names):
  devices = test_devices()
  need = int(np.prod(shape))
  if len(devices) < need:
    pytest.skip(f"needs {need} devices, {len(devices)} {devices[0].platform}"
                " devices visible")
  return jax.make_mesh(shape, names, devices=devices[:need])


def rand(rng, shape, dtype):
  return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.all(np.isfinite(out)), "non-finite output"
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def tol(dtype) -> float:
  """Relative-norm tolerance that fits the dtype (and GPU tf32 matmuls)."""
  dtype = np.dtype(dtype)
  if dtype == np.float64:
    return 1e-12 if not on_gpu() else 1e-10
  if dtype == np.float32:
    return 1e-5 if not on_gpu() else 3e-3
  return 2e-2  # bf16 / f16 operands, as the reference is rounded once too.


def ref_all_gather_matmul(x_global, w_global, gather_axis=0):
  """float64 reference of the global result (gathering is the identity)."""
  del gather_axis
  return np.asarray(x_global, np.float64) @ np.asarray(w_global, np.float64)


def ref_matmul_reduce_scatter(h_global, w_global):
  return np.asarray(h_global, np.float64) @ np.asarray(w_global, np.float64)


@contextlib.contextmanager
def lowered_under(monkeypatch, var: str, value: str):
  """Within the block, ``var=value``: ficco reads its transport switches
  when an op is lowered, so lowerings cached under another value are cleared
  on the way in and out."""
  monkeypatch.setenv(var, value)
  jax.clear_caches()
  try:
    yield
  finally:
    jax.clear_caches()


@contextlib.contextmanager
def never_arriving(device_ordinal: int):
  """Within the block, ficco's handlers on ``device_ordinal`` refuse to run
  (the library's never-arrive test hook), as a peer that never arrives."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  library.set_never_arrive(device_ordinal)
  try:
    yield
  finally:
    library.clear_never_arrive()


def window_entries_after(platform: str, timeout_s: float = 10.0) -> int:
  """The window invocations' wait/done and push entries still pending on
  ``platform`` once they drain or ``timeout_s`` passes (0: all drained)."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.dma import windows  # pylint: disable=g-import-not-at-top

  pid = library.platform_id(platform)
  deadline = time.monotonic() + timeout_s
  while windows.pending_entries(pid) and time.monotonic() < deadline:
    time.sleep(0.01)
  return windows.pending_entries(pid)

