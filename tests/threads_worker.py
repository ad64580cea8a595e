"""A process of test_threads.py: two host threads dispatch two copy-engine
programs that share 2 virtual CPU devices, then one thread calls them again.

In a process of its own: XLA:CPU's launch order depends on its device count
(the test process has 8 devices), and a hang stays in this process, which
the test kills. Prints one JSON line: per program, how many calls returned
the right result, how many failed with the error that says to dispatch from
one thread, and the other outcomes; the seconds the threads took; and
whether the calls made afterwards were right.

  python threads_worker.py CALLS DEPTH TIMEOUT_S QUIET_S
"""

import functools
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

import ficco_jax  # pylint: disable=g-import-not-at-top
import util  # pylint: disable=g-import-not-at-top

ADVICE = "dispatch them from one thread"


def main(calls: int, depth: int, timeout_s: float, quiet_s: float) -> None:
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
  put = lambda spec, a: jax.device_put(a, NamedSharding(mesh, spec))
  # The mix: a direct reduce-scatter and a two-chunk direct
  # all-gather, bf16, its global shapes divided by 16.
  mrs = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                        schedule=ficco_jax.Schedule.from_short("direct/c1/dma"),
                        timeout_s=timeout_s),
      mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
      out_specs=P("x", None)))
  agm = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                        schedule=ficco_jax.Schedule.from_short("direct/c2/dma"),
                        timeout_s=timeout_s),
      mesh=mesh, in_specs=(P("x", None), P(None, "x")),
      out_specs=P(None, "x")))
  rng = np.random.default_rng(0)
  rand = lambda *s: rng.standard_normal(s).astype(jnp.bfloat16)
  h, w1, x, w2 = rand(128, 256), rand(256, 128), rand(64, 256), rand(256, 256)
  f64 = lambda a: np.asarray(a, np.float64)
  jobs = {
      "matmul_reduce_scatter": (mrs, (put(P(None, "x"), h), put(P("x"), w1)),
                                f64(h) @ f64(w1)),
      "all_gather_matmul": (agm, (put(P("x"), x), put(P(None, "x"), w2)),
                            f64(x) @ f64(w2)),
  }

  def outcome(out, ref):
    try:
      if isinstance(out, Exception):  # Raised by the dispatch itself.
        raise out
      got = np.asarray(out, np.float64)
    except Exception as e:  # pylint: disable=broad-exception-caught
      return "clear" if ADVICE in str(e) else str(e)[:2000]
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    return "right" if err < 2e-2 else f"wrong result: relative error {err}"

  for f, args, ref in jobs.values():  # Compiled before the clock starts.
    assert outcome(f(*args), ref) == "right"

  report, elapsed = util.dispatch_from_threads(jobs, calls, depth, outcome)
  # Calls from one thread, once the devices have been quiet for a while.
  time.sleep(quiet_s)
  after = [outcome(f(*args), ref) for f, args, ref in jobs.values()]
  print(json.dumps({"report": report, "elapsed": elapsed, "after": after}),
        flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
       float(sys.argv[4]))
  sys.stdout.flush()
  os._exit(0)  # XLA's threads must not delay (or hang) the exit.
