"""Shared test helpers: device meshes, random data, float64 references, and
the two ops run under ``jit(shard_map)`` as a model would call them."""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax


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


def platform_mesh(platform: str, n: int = 4, at_least: int | None = None):
  """A 1-D mesh (axis "x") of the first ``n`` ``platform`` ("cpu" or
  "cuda") devices; with ``at_least``, as many as there are up to ``n`` (a
  2-GPU machine still runs the test). Skips when there are too few, or no
  CUDA handlers or backend."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  if platform == "cpu":
    devices = jax.devices("cpu")
  else:
    if not library.cuda_compiled():
      pytest.skip("CUDA handlers not compiled in")
    try:
      devices = jax.devices("cuda")
    except RuntimeError:
      pytest.skip("no CUDA backend")
  if at_least is not None and at_least <= len(devices) < n:
    n = len(devices)
  if len(devices) < n:
    pytest.skip(f"needs {n} {platform} devices, has {len(devices)}")
  return jax.sharding.Mesh(np.asarray(devices[:n]), ("x",))


def tp_mesh(max_size: int = 4, name: str = "x"):
  """A 1-D mesh of every test device up to ``max_size`` (at least 2): the
  ops' tests run at P = 4 on CPU and at the GPU count on a 2- or 4-GPU
  host. Size shapes by ``mesh.devices.size``."""
  n = min(max_size, len(test_devices()))
  return mesh((max(n, 2),), (name,))


def mosaic_gpu_interpret_params(monkeypatch):
  """jax's Mosaic GPU interpreter (CPU), which runs ficco's Hopper kernels
  themselves, or skip where this jax lacks it."""
  try:
    # pylint: disable=g-import-not-at-top
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError:
    pytest.skip("this jax has no Mosaic GPU interpret mode")
  # The interpreter (jax 0.10.2) gives operands such as an aliased Ref no
  # memory space; they are in GMEM like every other kernel operand.
  is_gmem = gpu_callbacks.is_gmem_memory_space
  monkeypatch.setattr(gpu_callbacks, "is_gmem_memory_space",
                      lambda space: space is None or is_gmem(space))
  return InterpretGPUParams()


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


def put(mesh, spec, a):
  return jax.device_put(a, NamedSharding(mesh, spec))


def run_ag(mesh, x, w, *, axis="x", gather_axis=0, x_spec=None,
           check_vma=True, **kw):
  """``ficco_jax.all_gather_matmul`` of global ``x`` (rows sharded over
  ``axis`` at ``gather_axis``) and ``w`` (columns sharded)."""
  x_spec = x_spec or P(*([None] * gather_axis), axis)
  out_spec = list(x_spec) + [None] * (x.ndim - len(x_spec))
  out_spec[gather_axis] = None
  out_spec[-1] = axis
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name=axis,
                        gather_axis=gather_axis, **kw),
      mesh=mesh, in_specs=(x_spec, P(None, axis)), out_specs=P(*out_spec),
      check_vma=check_vma))
  return f(put(mesh, x_spec, x), put(mesh, P(None, axis), w))


def run_rs(mesh, h, w, *, axis="x", scatter_axis=0, h_spec=None,
           check_vma=True, **kw):
  """``ficco_jax.matmul_reduce_scatter`` of global ``h`` (contraction
  sharded over ``axis``) and ``w`` (rows sharded)."""
  h_spec = h_spec or P(*([None] * (h.ndim - 1)), axis)
  out_spec = list(h_spec) + [None] * (h.ndim - len(h_spec))
  out_spec[-1] = None
  out_spec[scatter_axis] = axis
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name=axis,
                        scatter_axis=scatter_axis, **kw),
      mesh=mesh, in_specs=(h_spec, P(axis, None)), out_specs=P(*out_spec),
      check_vma=check_vma))
  return f(put(mesh, h_spec, h), put(mesh, P(axis, None), w))


def platform_name() -> str:
  """The ficco handlers' platform of the test devices."""
  return "cuda" if on_gpu() else "cpu"


@contextlib.contextmanager
def failing_at(device_ordinal: int, step: str):
  """Within the block, ficco's handlers of protocol ``step`` ("start",
  "wait" or "done") on ``device_ordinal`` fail at once (the fault hook)."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  library.set_fault(device_ordinal, step)
  try:
    yield
  finally:
    library.clear_faults()


@contextlib.contextmanager
def never_arriving(device_ordinal: int):
  """Within the block, ficco's handlers on ``device_ordinal`` refuse to run
  (the library's never-arrive test hook), as a peer that never arrives."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  library.set_never_arrive(device_ordinal)
  try:
    yield
  finally:
    library.clear_faults()


def _after(count, timeout_s: float) -> int:
  """``count()`` once it reaches 0 or ``timeout_s`` passes."""
  deadline = time.monotonic() + timeout_s
  while count() and time.monotonic() < deadline:
    time.sleep(0.01)
  return count()


def window_entries_after(platform: str, timeout_s: float = 10.0) -> int:
  """The window invocations' wait/done and push entries still pending on
  ``platform`` once they drain or ``timeout_s`` passes (0: all drained)."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top
  from ficco_jax._src.dma import windows  # pylint: disable=g-import-not-at-top

  pid = library.platform_id(platform)
  return _after(lambda: windows.pending_entries(pid), timeout_s)


def library_entries_after(platform: str, timeout_s: float = 10.0) -> int:
  """The rendezvous entries (and, on CPU, wait deadline timers) still
  pending on ``platform`` once they drain or ``timeout_s`` passes."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  return _after(lambda: library.pending_entries(platform), timeout_s)


def live_invocations_after(platform: str, timeout_s: float = 10.0) -> int:
  """The rendezvous invocations still alive on ``platform`` once every
  rank released them or ``timeout_s`` passes."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  return _after(lambda: library.live_invocations(platform), timeout_s)



def dispatch_from_threads(jobs, calls: int, depth: int, outcome):
  """Calls every job of ``jobs`` ({name: (fn, args, ref)}) ``calls`` times
  from a thread of its own, the threads released together, each reading its
  results ``depth`` calls at a time.

  Args:
    jobs: {name: (jitted program, its arguments, the reference result)}.
    calls: calls per job.
    depth: calls in flight per thread before their results are read.
    outcome: ``outcome(out, ref)`` names one call's result (``out`` is the
      exception if dispatching the call raised): "right", a string that
      starts with "clear" (it failed with the advised error), or anything
      else (kept as is).

  Returns:
    ({name: {"right": count, "clear": count, "other": [outcomes]}}, the
    seconds the threads took).
  """
  barrier = threading.Barrier(len(jobs))
  report = {name: {"right": 0, "clear": 0, "other": []} for name in jobs}

  def dispatch(name):
    f, args, ref = jobs[name]
    barrier.wait()
    pending = []
    for i in range(calls):
      try:
        pending.append(f(*args))
      except Exception as e:  # pylint: disable=broad-exception-caught
        pending.append(e)
      if len(pending) == depth or i == calls - 1:
        for out in pending:
          o = outcome(out, ref)
          if o == "right" or o.startswith("clear"):
            report[name][o.split(":")[0]] += 1
          else:
            report[name]["other"].append(o)
        pending.clear()

  threads = [threading.Thread(target=dispatch, args=(n,)) for n in jobs]
  t0 = time.monotonic()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return report, time.monotonic() - t0
