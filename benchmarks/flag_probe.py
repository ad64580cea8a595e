"""Probe (one Hopper GPU): can a Mosaic GPU warpgroup-semantics kernel bump
an int32 counter in GMEM, and how many increments land per signalling
warpgroup? Variants: plgpu.atomic_add on a (1,) ref; a release.sys red.add
through ficco's own primitive (ficco_jax._src.pallas.flag_signal).

Prints one line per variant: ok/failed, the counts, the expected count.
"""
import functools
import sys
import traceback

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def run(variant, grid=16, flags_n=4, threads=3):
  def body(flags_ref):
    sm = lax.axis_index("sm")
    wg = lax.axis_index("wg")

    @pl.when(wg < threads - 1)
    def _():
      k = sm % flags_n
      if variant == "atomic_add_1":
        plgpu.atomic_add(flags_ref.at[pl.ds(k, 1)], jnp.ones((1,), jnp.int32))
      elif variant == "ficco_signal":
        from ficco_jax._src.pallas import flag_signal
        flag_signal.signal(flags_ref, k)
      else:
        raise ValueError(variant)

  kernel = pl.kernel(
      body, out_type=(),
      mesh=plgpu.Mesh(grid=(grid,), grid_names=("sm",), num_threads=threads,
                      thread_name="wg"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="flag_probe")

  @jax.jit
  def f(z):
    ref = jax.new_ref(z)
    kernel(ref)
    return jax.freeze(ref)

  out = f(jnp.full((flags_n,), 7, jnp.int32))
  return [int(v) for v in out], 7 + grid // flags_n * (threads - 1)


if __name__ == "__main__":
  print(jax.__version__, jax.devices()[0].device_kind)
  for v in sys.argv[1:] or ["atomic_add_1", "ficco_signal"]:
    try:
      got, want = run(v)
      print(f"{v}: ok counts={got} expected_if_one_per_wg={want}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"{v}: FAILED {type(e).__name__}: {str(e)[:600]}")
      traceback.print_exc(limit=3)
