"""A release-ordered counter bump in GMEM from a Mosaic GPU kernel.

The flagged reduce-scatter's kernel tells the copy engines that a piece is
complete by bumping that piece's int32 counter in device memory (each
compute warpgroup of a CTA once, after the CTA's last tile of the piece);
a side stream waits for the count (`cuStreamWaitValue32`) before the
piece's copies start. The bump must come after the warpgroup's stores and be visible to another agent (the stream front end, the copy
engine): one lane issues ``red.release.sys.global.add.u32``, the release
at system scope that jax's own ``semaphore_signal`` uses. jax exposes that
instruction only on semaphore-typed refs, which live in memory jax owns;
here the counters are an ordinary int32 buffer that XLA allocates and the
peer-copy protocol reads, so this module binds its own primitive with
jax's lowering helpers (private: checked against jax 0.10 and 0.11).
GPU only; the portable path computes the counts itself.
"""

from __future__ import annotations

import jax
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types

flag_signal_p = jax_core.Primitive("ficco_flag_signal")
flag_signal_p.multiple_results = True


def signal(flags_ref, index) -> None:
  """Adds one to ``flags_ref[index]`` (int32, GMEM) with release semantics,
  from one lane of the calling warpgroup, after a warpgroup barrier.

  Call it after ``wait_smem_to_gmem(0, wait_read_only=False)``: the stores
  it publishes must be complete, not only read out of shared memory.
  """
  ref, transforms = state_primitives.get_ref_and_transforms(
      flags_ref.at[jax.lax.convert_element_type(index, "int32")], None,
      "ficco_flag_signal")
  flat, tree = tree_util.tree_flatten((ref, transforms))
  flag_signal_p.bind(*flat, args_tree=tree)


@flag_signal_p.def_effectful_abstract_eval
def _abstract_eval(*avals, args_tree):
  ref_aval, _ = tree_util.tree_unflatten(args_tree, avals)
  if not isinstance(ref_aval, state_types.AbstractRef):
    raise TypeError(f"flags_ref must be a Ref, got {ref_aval}.")
  if ref_aval.dtype != jax.numpy.int32:
    raise TypeError(f"flags_ref.dtype={ref_aval.dtype} must be int32.")
  return [], {state_types.WriteEffect(0)}


def _register_lowering() -> None:
  """Registers the Mosaic GPU lowering (imports need the GPU extras)."""
  from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # pylint: disable=g-import-not-at-top
  from jax.experimental import mosaic  # pylint: disable=g-import-not-at-top,unused-import
  from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # pylint: disable=g-import-not-at-top

  def rule(ctx, *args, args_tree):
    ref, transforms = tree_util.tree_unflatten(args_tree, args)
    ref_aval, transform_avals = tree_util.tree_unflatten(args_tree,
                                                         ctx.avals_in)
    ref, _, rest = mgpu_lowering._handle_transforms(  # pylint: disable=protected-access
        ctx, ref_aval, ref, list(transform_avals), list(transforms))
    if rest:
      raise NotImplementedError(f"ficco_flag_signal: transforms {rest}")
    with mgpu_lowering._wrap_in_custom_primitive_if_wg(ctx, [ref]) as [ref]:  # pylint: disable=protected-access
      ptr = mgpu_utils.memref_ptr(ref)
      # Every thread of the warpgroup has passed its part of the epilogue
      # before the one lane publishes it.
      mgpu_utils.warpgroup_barrier()
      mgpu_utils.SemaphoreRef(ptr).signal(
          1, predicate=ctx.module_ctx.single_lane_predicate,
          memory_scope="sys")
    return ()

  for sem in (mgpu.LoweringSemantics.Lane, mgpu.LoweringSemantics.Warpgroup):
    mgpu_lowering.register_lowering_rule(flag_signal_p, sem)(rule)


try:
  _register_lowering()
except ImportError:  # A jaxlib without Mosaic GPU: the portable path only.
  pass
