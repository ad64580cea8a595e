"""What one call of a collective matmul is: its static config and its dots.

Both ops, both directions of autodiff and every dataflow share these: the
`Static` config a call is traced with, the XLA dot it runs on a piece, and
the dtypes of its result and of its sums.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from ficco_jax._src import schedule as schedule_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Static:
  """Everything about one call that is not an array (hashable).

  Attributes:
    axis_name: the ``shard_map`` axis gathered or scattered over.
    axis_size: devices along it, ``P``.
    schedule: the resolved schedule.
    precision: passed to ``lax.dot_general``.
    preferred_element_type: the dot's result dtype (None: as for ``a @ w``).
    op_name: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``: which
      op this call is (the backward of one op runs the other).
    timeout_s: how long a copy-engine wait for peers may take.
  """

  axis_name: str
  axis_size: int
  schedule: schedule_lib.Schedule
  precision: Any
  preferred_element_type: Any
  op_name: str
  timeout_s: float

  def copy_kwargs(self) -> dict[str, Any]:
    """The keywords every peer-copy primitive of this call takes
    (`ficco_jax._src.dma.peer_copy`)."""
    return dict(axis_name=self.axis_name, op_name=self.op_name,
                timeout_s=self.timeout_s, transport=self.schedule.transport)


def make_static(op: str, *, axis_name: str, axis_size: int,
                schedule: schedule_lib.Schedule, precision: Any,
                preferred_element_type: Any, timeout_s: float) -> Static:
  """The `Static` of a public call (its arguments checked by the caller,
  `ops.prepare`)."""
  try:
    pet = (None if preferred_element_type is None
           else np.dtype(preferred_element_type))
  except TypeError as e:
    raise TypeError(f"{op}: preferred_element_type={preferred_element_type!r}"
                    " is not a dtype (e.g. jnp.float32).") from e
  return Static(axis_name=axis_name, axis_size=axis_size, schedule=schedule,
                precision=precision, preferred_element_type=pet, op_name=op,
                timeout_s=float(timeout_s))


def dot(a: jax.Array, w: jax.Array, st: Static) -> jax.Array:
  """``a @ w`` over ``a``'s last axis, as ``st`` says."""
  return lax.dot_general(a, w, (((a.ndim - 1,), (0,)), ((), ())),
                         precision=st.precision,
                         preferred_element_type=st.preferred_element_type)


def dot_dtype(a, w, st: Static):
  """The result dtype of ``a @ w`` under ``st`` (what the reference returns)."""
  return jax.eval_shape(lambda a, b: dot(a, b, st), a, w).dtype


def acc_dtype(dtype):
  """The dtype partial products are summed in: at least float32 (float64
  stays float64), so the ``P`` bf16 partials that land on one device
  (``direct``) are rounded once; the ring's running sums travel in the
  result dtype, rounded at each hop (docs/schedules.md)."""
  return jnp.promote_types(dtype, jnp.float32)


def backward_static(st: Static, op: str) -> Static:
  """The config of the collective matmuls that make up a gradient.

  The backward matmuls keep the forward schedule's dataflow, chunks, comm
  engine and transport, on XLA dots: gradients may arrive in float32
  (``preferred_element_type``), which the Hopper kernels do not take.
  """
  schedule = st.schedule
  if schedule.compute_granularity == "flagged":
    # Flagged needs ficco's kernel, which the backward's XLA dots are not:
    # its gradients run "piece" (the same overlap, one start per piece),
    # over the transport a piece-wise op takes.
    schedule = dataclasses.replace(
        schedule, compute_granularity="piece",
        transport=None if schedule.transport == "push" else schedule.transport)
  schedule = dataclasses.replace(schedule, compute="xla", num_sms=None,
                                 reduce_in_epilogue=False)
  if op == "all_gather_matmul" and schedule.compute_granularity == "halving":
    # A reduce-scatter's "halving" has no all-gather form: its gradient's
    # gather runs at the all-gather's default granularity.
    schedule = dataclasses.replace(schedule, compute_granularity=None)
  return dataclasses.replace(st, schedule=schedule, op_name=op,
                             preferred_element_type=None)
