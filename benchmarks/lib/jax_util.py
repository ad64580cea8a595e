"""JAX plumbing of the suites: meshes, random inputs, correctness checks."""

from __future__ import annotations

import time

from lib import results
from lib import timing


def mesh_of(w: int):
  """A 1-D mesh ``("x",)`` of the first ``w`` devices."""
  import jax
  import numpy as np
  devs = jax.devices()
  if w > len(devs):
    raise ValueError(f"axis size {w} > {len(devs)} devices")
  return jax.sharding.Mesh(np.array(devs[:w]), ("x",))


def random_array(mesh, shape, spec, key: int, dtype=None):
  """Random normal array made on the devices, laid out as ``spec``."""
  import jax
  import jax.numpy as jnp
  sharding = jax.sharding.NamedSharding(mesh, spec)
  gen = jax.jit(lambda k: jax.random.normal(k, shape, dtype or jnp.bfloat16),
                out_shardings=sharding)
  return gen(jax.random.key(key))


def rel_err(out, ref) -> float:
  """``||out - ref|| / ||ref||`` in f32 (NaN stays NaN and fails checks);
  for tuples of arrays (gradients), the largest over their entries."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def f(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)

  errs = [float(f(a, b)) for a, b in zip(jax.tree.leaves(out),
                                         jax.tree.leaves(ref), strict=True)]
  # max() would drop a NaN; a NaN must fail the check.
  return float("nan") if any(e != e for e in errs) else max(errs)


def jit_shard_map(body, mesh, in_specs, out_specs, check_vma=True):
  import jax
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs, check_vma=check_vma))


def first_call(build, args):
  """Compiles and runs once; retries with check_vma=False if VMA rejects it.

  Args:
    build: ``build(check_vma) -> jitted fn``.
    args: one argument tuple.

  Returns:
    (fn, out, compile_s, notes).
  """
  import jax
  notes = {}
  fn = build(True)
  t0 = time.perf_counter()
  try:
    out = jax.block_until_ready(fn(*args))
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e).lower()
    if "vma" not in msg and "varying" not in msg:
      raise
    notes["check_vma"] = f"False (True failed: {results.short_error(e, 300)})"
    fn = build(False)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
  return fn, out, time.perf_counter() - t0, notes


def check(record: dict, out, ref32, *, tol: float,
          xla_err: float | None) -> None:
  """Adds ``rel_err`` (against the f32 reference) and ``ok`` to a record:
  ok if within max(tol, 2 x XLA's own bf16 error), and not NaN."""
  err = rel_err(out, ref32)
  record["rel_err"] = err
  limit = max(tol, 2 * xla_err) if xla_err is not None else tol
  record["ok"] = bool(err == err and err <= limit)  # err == err: not NaN.


def measure(build, *, args, ref32, xla_err, tol, tk) -> dict:
  """Compiles and checks once against the f32 reference, then times.

  Inside `timing.interleaved` the returned dict is filled when the block
  exits: callers keep this very dict as their record.
  """
  fn, out, compile_s, notes = first_call(build, args[0])
  res = dict(notes, compile_s=compile_s)
  if ref32 is not None:
    check(res, out, ref32, tol=tol, xla_err=xla_err)
  del out
  timed = timing.time_jax(fn, args, **tk)
  timed.update(res)
  return timed
