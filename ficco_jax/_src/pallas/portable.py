"""The portable chunk-matmul kernel: a plain ``pl.pallas_call``.

A ``(mc // block_m, n // block_n)`` grid with BlockSpecs for ``x`` and
``w``, and the output left in place (``pl.ANY``, aliased to ``out``): each
block is written at a dynamic row offset read from a scalar operand
(`offsets.offset_operand`). It runs under ``interpret=True`` on CPU, which is
how CI tests the chunk/offset logic; GPUs run the Hopper kernel
(`hopper.py`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ficco_jax._src import vma
from ficco_jax._src.pallas import out_types


def largest_divisor_at_most(v: int, cap: int) -> int:
  for d in range(min(v, cap), 0, -1):
    if v % d == 0:
      return d
  return 1


def _kernel(off_ref, x_ref, w_ref, out_in_ref, out_ref, *, block_m, block_n):
  # off_ref:    (2,) int32, whole: [0] first row of the chunk inside out.
  # x_ref:      (block_m, K) block of x at (i, 0).
  # w_ref:      (K, block_n) block of w at (0, j).
  # out_in_ref: (M, n) all of out, unblocked (pl.ANY); aliased to out_ref and
  #             never read: it is here only to carry the aliasing.
  # out_ref:    (M, n) all of out, unblocked (pl.ANY); the product's block
  #             lands at rows off + i * block_m, columns j * block_n.
  del out_in_ref
  i, j = pl.program_id(0), pl.program_id(1)
  acc = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  rows = pl.ds(off_ref[0] + i * block_m, block_m)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
  out_ref[rows, cols] = acc.astype(out_ref.dtype)


def portable_into(out, x, w, off, *, interpret):
  """``x [mc, K] @ w [K, n]`` into rows ``off[0]:`` of ``out [M, n]``
  (aliased: the other rows keep their values)."""
  mc, k = x.shape
  n = w.shape[1]
  # Blocks need not be aligned in interpret mode; take the largest divisors so
  # any mc and n work without masking.
  block_m = largest_divisor_at_most(mc, 128)
  block_n = largest_divisor_at_most(n, 256)
  if any(vma.varying_axes(a) for a in (off, x, w, out)):
    # The interpreter runs the kernel's body as jax ops whose grid indices
    # are typed invariant, which shard_map's check_vma rejects beside a
    # varying operand; only the compiled kernels on GPUs are typed.
    raise ValueError(
        "compute='pallas' off GPUs runs Pallas's interpreter, which does not"
        " take shard_map's varying-axes checks: call jax.shard_map(...,"
        " check_vma=False) around it, or use Schedule(compute='xla').")
  return pl.pallas_call(
      functools.partial(_kernel, block_m=block_m, block_n=block_n),
      out_shape=out_types.out_type(out.shape, out.dtype, like=(out,)),
      grid=(mc // block_m, n // block_n),
      in_specs=[
          pl.BlockSpec(memory_space=pl.ANY),
          pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
          pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
          pl.BlockSpec(memory_space=pl.ANY),
      ],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      input_output_aliases={3: 0},
      name="ficco_chunk_matmul_into",
      interpret=interpret,
  )(off, x, w, out)
