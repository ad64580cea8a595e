"""The late-landing test hook (``xla_ffi/late_landing.h``).

Stands in for a copy engine that lands a buffer piece by piece behind
landing flags, on one device: the tests of the signalled all-gather's
kernel (`chunk_matmul.chunk_matmul_pieces` with ``landed``) need a buffer
that is still being written when the kernel starts, which the window
transport only gives with two GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ficco_jax._src.dma import attrs
from ficco_jax._src.dma import library


def late_landing(src: jax.Array, rows: Sequence[int], *, delay_ms: int = 0
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Lands ``src`` piece by piece.

  Args:
    src: ``[sum(rows), ...]``, the data to land.
    rows: rows of each piece, in landing order.
    delay_ms: on CUDA, how long the side stream sleeps before the first
      piece lands (the CPU twin lands everything at once).

  Returns:
    ``(landing, flags, src)``: ``landing`` like ``src``, zeroed, then
    written piece by piece; ``flags`` ``int32[len(rows)]``, flag ``i`` set
    to 1 once piece ``i`` has landed; ``src`` itself (aliased), to be kept
    alive until every reader of ``landing`` is done. Then `join`: nothing
    else orders the late copies before XLA reuses the three buffers.
  """
  rows = [int(r) for r in rows]
  if not rows or any(r < 1 for r in rows) or sum(rows) != src.shape[0]:
    raise ValueError(f"rows={rows} must be positive and sum to"
                     f" src.shape[0]={src.shape[0]}.")
  if isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or (
      delay_ms < 0):
    raise ValueError(f"delay_ms={delay_ms!r} must be an int >= 0.")
  library.ensure_registered()
  call = jax.ffi.ffi_call(
      "ficco_test_late_landing",
      (jax.ShapeDtypeStruct(src.shape, src.dtype),
       jax.ShapeDtypeStruct((len(rows),), jnp.int32),
       jax.ShapeDtypeStruct(src.shape, src.dtype)),
      has_side_effect=True, input_output_aliases={0: 2})
  given = attrs.full(dict(op_name="late_landing", timeout_ms=delay_ms,
                          rows=np.asarray(rows, np.int64)))
  return tuple(call(src, **given))


def join(x: jax.Array) -> jax.Array:
  """``x`` (aliased), once the device's last `late_landing` has landed:
  the compute stream waits for it. Pass it a value computed after every
  reader of the landing (their result), in the same program."""
  library.ensure_registered()
  call = jax.ffi.ffi_call("ficco_test_late_landing_join",
                          jax.ShapeDtypeStruct(x.shape, x.dtype),
                          has_side_effect=True, input_output_aliases={0: 0})
  return call(x)
