"""ficco_jax demo: both collective matmuls, checked against a reference.

Runs on the local GPUs when there are at least two, else on 8 virtual CPU
devices. For each op it runs the default schedule (``schedule=None``) and a
few explicit ones, compares every result with a float64 reference, and prints
the schedule that ran.

  python examples/demo.py
"""

import os
import sys

# Size the CPU platform before jax starts (ignored where GPUs are used).
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:  # Keep the user's.
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

import ficco_jax
from ficco_jax import Schedule


def _devices():
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  return gpus if len(gpus) >= 2 else jax.devices("cpu")


def _rel_err(out, ref):
  out = np.asarray(out, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main() -> int:
  devices = _devices()
  p = len(devices)
  on_gpu = devices[0].platform == "gpu"
  mesh = jax.make_mesh((p,), ("tp",), devices=devices)
  # Sizes that are not powers of two; large enough on GPUs to be worth
  # overlapping, small enough on CPUs to run in seconds.
  m_local, k, n_local = (2048, 4096, 1792) if on_gpu else (48, 72, 40)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  tol = 2e-2 if on_gpu else 1e-5
  rng = np.random.default_rng(0)
  x = rng.standard_normal((p * m_local, k)).astype(np.float32)
  w = rng.standard_normal((k, p * n_local)).astype(np.float32)
  h = rng.standard_normal((p * m_local, p * n_local)).astype(np.float32)
  w2 = rng.standard_normal((p * n_local, k)).astype(np.float32)
  xd, wd, hd, w2d = (jnp.asarray(a, dtype) for a in (x, w, h, w2))
  print(f"ficco_jax {ficco_jax.__version__} on {p} {devices[0].device_kind}"
        f" devices (jax {jax.__version__}), dtype {np.dtype(dtype).name}")

  comm = "dma"  # The copy-engine protocol: CUDA on GPUs, its CPU twin here.
  cases = {
      "all_gather_matmul": (
          ficco_jax.sharded.all_gather_matmul, xd, wd,
          np.asarray(xd, np.float64) @ np.asarray(wd, np.float64),
          (m_local, k), (k, n_local)),
      "matmul_reduce_scatter": (
          ficco_jax.sharded.matmul_reduce_scatter, hd, w2d,
          np.asarray(hd, np.float64) @ np.asarray(w2d, np.float64),
          (p * m_local, n_local), (n_local, k)),
  }
  failures = 0
  for op, (fn, a, b, ref, a_local, b_local) in cases.items():
    schedules = [None, Schedule(dataflow="direct", num_chunks=4),
                 Schedule(dataflow="bidirectional", num_chunks=2),
                 Schedule(dataflow="ring", num_chunks=2, comm=comm),
                 Schedule(dataflow="direct", num_chunks=4, comm=comm)]
    for schedule in schedules:
      ran = schedule or ficco_jax.choose_schedule(
          op, x_shape=a_local, w_shape=b_local, dtype=dtype, axis_size=p)
      f = jax.jit(lambda a, b, s=schedule, fn=fn: fn(
          a, b, mesh=mesh, axis_name="tp", schedule=s))
      err = _rel_err(f(a, b), ref)
      ok = err < tol
      failures += not ok
      label = "default -> " if schedule is None else ""
      print(f"  {op:22s} {label + ran.short():32s} rel_err={err:.1e}"
            f" {'ok' if ok else 'FAILED'}")
  print("all results match the reference" if not failures
        else f"{failures} result(s) did not match")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
