"""The weight gradient of both ops: a contraction with a gathered operand.

``dw`` of ``all_gather(x) @ w`` is ``all_gather(x)^T @ ct``, and ``dw`` of
``psum_scatter(h @ w)`` is ``h^T @ all_gather(ct)``. The gathered operand
is at hand in both (the all-gather's forward kept it, the push all-gather's
copied out of its windows; the reduce-scatter's ``dh`` gathered the
cotangent), so `contract_rows` is one dot.
"""

from __future__ import annotations

import jax
from jax import lax

from ficco_jax._src.matmul import Static


def contract_rows(a: jax.Array, g: jax.Array, st: Static,
                  out_dtype) -> jax.Array:
  """``a^T @ g`` over every axis but the last, both operands whole (one dot
  in ``out_dtype``; the accumulation inside it is the dot's own, f32 for
  16-bit operands on GPUs)."""
  lead = tuple(range(a.ndim - 1))
  return lax.dot_general(a, g, ((lead, lead), ((), ())),
                         precision=st.precision,
                         preferred_element_type=out_dtype)
