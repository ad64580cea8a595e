"""Int32 flags in GMEM that a Mosaic GPU kernel bumps or waits for.

The copy engines and ficco's kernels hand pieces to each other through
int32 counters in device memory, which the peer-copy protocol reads and
writes from streams (``cuStreamWaitValue32`` / ``cuStreamWriteValue32``):

* `signal`: the flagged reduce-scatter's kernel tells the copy engines that
  a piece is complete by bumping that piece's counter (each compute
  warpgroup of a CTA once, after the CTA's last tile of the piece); a side
  stream waits for the count before the piece's copies start. The bump must
  come after the warpgroup's stores and be visible to another agent (the
  stream front end, the copy engine): one lane issues
  ``red.release.sys.global.add.u32``, the release at system scope that
  jax's own ``semaphore_signal`` uses.
* `wait`: the signalled all-gather's kernel waits, before the first TMA
  load of a piece, until the copy queue that landed the piece has written
  its flag (after the copy, which the write's default flags fence). One
  lane polls with ``ld.relaxed.sys`` and the warpgroup passes an acquire
  fence (jax's ``SemaphoreRef.wait`` without the decrement), then a proxy
  fence orders the TMA loads (the async proxy) after it.

jax exposes these instructions only on semaphore-typed refs, which live in
memory jax owns; here the flags are an ordinary int32 buffer that XLA
allocates and the peer-copy protocol touches, so this module binds its own
primitives with jax's lowering helpers (private: checked against jax 0.10
and 0.11). GPU only: the portable and interpreted paths have no atomics
(their callers count or wait elsewhere).
"""

from __future__ import annotations

import jax
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types

flag_signal_p = jax_core.Primitive("ficco_flag_signal")
flag_signal_p.multiple_results = True
flag_wait_p = jax_core.Primitive("ficco_flag_wait")
flag_wait_p.multiple_results = True


def _bind(prim, flags_ref, index, name, **params) -> None:
  ref, transforms = state_primitives.get_ref_and_transforms(
      flags_ref.at[jax.lax.convert_element_type(index, "int32")], None, name)
  flat, tree = tree_util.tree_flatten((ref, transforms))
  prim.bind(*flat, args_tree=tree, **params)


def signal(flags_ref, index) -> None:
  """Adds one to ``flags_ref[index]`` (int32, GMEM) with release semantics,
  from one lane of the calling warpgroup, after a warpgroup barrier.

  Call it after ``wait_smem_to_gmem(0, wait_read_only=False)``: the stores
  it publishes must be complete, not only read out of shared memory.
  """
  _bind(flag_signal_p, flags_ref, index, "ficco_flag_signal")


def wait(flags_ref, index, target: int = 1) -> None:
  """Blocks the calling warpgroup until ``flags_ref[index]`` (int32, GMEM)
  is at least ``target`` (unsigned), with acquire semantics at system
  scope, then fences the async proxy: TMA loads issued after it read what
  the flag's writer wrote before the flag.
  """
  if isinstance(target, bool) or not isinstance(target, int) or target < 1:
    raise ValueError(f"target={target!r} must be a positive int.")
  _bind(flag_wait_p, flags_ref, index, "ficco_flag_wait", target=target)


def _abstract_eval(*avals, args_tree, **_):
  ref_aval, _ = tree_util.tree_unflatten(args_tree, avals)
  if not isinstance(ref_aval, state_types.AbstractRef):
    raise TypeError(f"flags_ref must be a Ref, got {ref_aval}.")
  if ref_aval.dtype != jax.numpy.int32:
    raise TypeError(f"flags_ref.dtype={ref_aval.dtype} must be int32.")
  return [], {state_types.WriteEffect(0)}


# Both are typed as writes of the flag, the wait too: it reads, but a read
# of a flag that changes under the kernel must not be reordered or dropped,
# and a write is an effect jax keeps in order.
flag_signal_p.def_effectful_abstract_eval(_abstract_eval)
flag_wait_p.def_effectful_abstract_eval(_abstract_eval)


def _register_lowering() -> None:
  """Registers the Mosaic GPU lowerings (imports need the GPU extras)."""
  from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # pylint: disable=g-import-not-at-top
  from jax.experimental import mosaic  # pylint: disable=g-import-not-at-top,unused-import
  from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # pylint: disable=g-import-not-at-top
  from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jaxlib.mlir.dialects import llvm  # pylint: disable=g-import-not-at-top

  def flag_ref(ctx, args, args_tree, name):
    ref, transforms = tree_util.tree_unflatten(args_tree, args)
    ref_aval, transform_avals = tree_util.tree_unflatten(args_tree,
                                                         ctx.avals_in)
    ref, _, rest = mgpu_lowering._handle_transforms(  # pylint: disable=protected-access
        ctx, ref_aval, ref, list(transform_avals), list(transforms))
    if rest:
      raise NotImplementedError(f"{name}: transforms {rest}")
    return ref

  def signal_rule(ctx, *args, args_tree):
    ref = flag_ref(ctx, args, args_tree, "ficco_flag_signal")
    with mgpu_lowering._wrap_in_custom_primitive_if_wg(ctx, [ref]) as [ref]:  # pylint: disable=protected-access
      ptr = mgpu_utils.memref_ptr(ref)
      # Every thread of the warpgroup has passed its part of the epilogue
      # before the one lane publishes it.
      mgpu_utils.warpgroup_barrier()
      mgpu_utils.SemaphoreRef(ptr).signal(
          1, predicate=ctx.module_ctx.single_lane_predicate,
          memory_scope="sys")
    return ()

  def wait_rule(ctx, *args, args_tree, target):
    ref = flag_ref(ctx, args, args_tree, "ficco_flag_wait")
    with mgpu_lowering._wrap_in_custom_primitive_if_wg(ctx, [ref]) as [ref]:  # pylint: disable=protected-access
      ptr = mgpu_utils.memref_ptr(ref)
      # One lane polls (relaxed, system scope: the writer is a copy
      # queue), then an acquire fence and a warpgroup barrier.
      mgpu_utils.SemaphoreRef(ptr).wait(
          target, decrement=False, scope=mgpu_utils.ThreadSubset.WARPGROUP,
          memory_scope="sys")
      # The piece is read by TMA, the async proxy: order it after the
      # acquire, which only covers the generic proxy.
      llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                      "fence.proxy.async.global;", "",
                      has_side_effects=True)
    return ()

  for sem in (mgpu.LoweringSemantics.Lane, mgpu.LoweringSemantics.Warpgroup):
    mgpu_lowering.register_lowering_rule(flag_signal_p, sem)(signal_rule)
    mgpu_lowering.register_lowering_rule(flag_wait_p, sem)(wait_rule)


try:
  _register_lowering()
except ImportError:  # A jaxlib without Mosaic GPU: the portable path only.
  pass
