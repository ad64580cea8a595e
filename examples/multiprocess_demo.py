"""ficco_jax with one JAX process per GPU (or per group of CPU devices).

The same API as in one process: jit(shard_map(...)) over a mesh whose
tensor-parallel axis spans the processes. comm="dma" then uses the window
transport (docs/windows.md): windows mapped once through CUDA IPC (or
shared memory on CPUs), handles exchanged through JAX's distributed
key-value store. Start it with the launcher, which gives each process its
GPUs (or virtual CPU devices) and stops them all if one fails:

  python -m ficco_jax.launch -n 4 examples/multiprocess_demo.py          # 4 GPUs
  JAX_PLATFORMS=cpu python -m ficco_jax.launch -n 2 --devices_per_process=2 \\
      examples/multiprocess_demo.py                                      # CPU
"""

import functools
import sys

from ficco_jax import launch

# Before anything touches a JAX backend: jax.distributed.initialize with the
# launcher's coordinator, process id and device split.
launch.initialize_from_env()

import jax  # pylint: disable=g-import-not-at-top,g-bad-import-order
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule


def _global(mesh, spec, a):
  """A global array from the same host data in every process."""
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                      lambda idx: a[idx])


def main() -> int:
  jax.config.update("jax_default_matmul_precision", "highest")
  p = jax.device_count()
  mesh = jax.make_mesh((p,), ("tp",))
  rng = np.random.default_rng(0)  # The same data in every process.
  x = rng.standard_normal((p * 24, 40)).astype(np.float32)
  w = rng.standard_normal((40, p * 12)).astype(np.float32)
  ok = True
  for schedule in (Schedule(dataflow="ring", comm="dma"),
                   Schedule(dataflow="direct", num_chunks=2, comm="dma"),
                   Schedule(dataflow="ring", comm="xla")):
    f = jax.jit(jax.shard_map(
        functools.partial(ficco_jax.all_gather_matmul, axis_name="tp",
                          schedule=schedule),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
    out = f(_global(mesh, P("tp"), x), _global(mesh, P(None, "tp"), w))
    ref = x.astype(np.float64) @ w
    # Each process checks the shards it holds.
    err = max(float(np.abs(np.asarray(s.data) - ref[s.index]).max())
              for s in out.addressable_shards)
    ok &= err < 1e-4
    if jax.process_index() == 0:
      print(f"all_gather_matmul {schedule.short():24s} over {p} devices in"
            f" {jax.process_count()} processes: max abs err {err:.1e}",
            flush=True)
  # Every process checked its own shards: the verdict is all of theirs.
  oks = multihost_utils.process_allgather(np.int32(ok))
  if jax.process_index() == 0:
    bad = [i for i, v in enumerate(np.ravel(oks)) if not v]
    print("all results match the reference in every process" if not bad
          else f"FAILED: results did not match in processes {bad}",
          flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
