"""The ficco calls a function makes, recorded while it is traced.

`ficco_jax.autotune_model` traces the user's function under `recording` and
gets back every call that left its schedule to ``schedule=None``: what the
autotune cache is keyed by (op, local shapes, dtype, axis size, axis, and
the kind of the devices the call is traced for), the axis name (to find
devices to tune on), and what the call resolved to.
Calls with an explicit ``schedule`` are the caller's choice, not a site to
tune, and calls under ``jax.vmap`` are not recorded (`ops.prepare`): their
traced shape is one example's, not the work that runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import numpy as np

from ficco_jax._src import devices
from ficco_jax._src import schedule as schedule_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
  """One call's problem: what the op saw inside ``shard_map``.

  Attributes:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    x_shape: the local shape of the first operand (``x`` or ``h``).
    w_shape: the local shape of ``w``.
    dtype: the operands' dtype name, after promotion.
    axis_size: devices along ``axis_name``.
    axis: the gathered or scattered axis of the first operand.
    axis_name: the mesh axis the op communicates over.
    device_kind: the kind of the devices it is traced for (keys its
      autotune entry).
  """

  op: str
  x_shape: tuple[int, ...]
  w_shape: tuple[int, ...]
  dtype: str
  axis_size: int
  axis: int
  axis_name: str
  device_kind: str

  def describe(self) -> str:
    return (f"{self.op} x{list(self.x_shape)} w{list(self.w_shape)}"
            f" {self.dtype} over {self.axis_name!r} (P={self.axis_size})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
  """A recorded call: its site and what ``schedule=None`` resolved to."""

  site: Site
  schedule: schedule_lib.Schedule
  source: str


_calls: contextvars.ContextVar[list[Call] | None] = contextvars.ContextVar(
    "ficco_jax_recorded_calls", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
  """Records the ``schedule=None`` calls traced inside the block, in order.

  Only calls that are traced record: JAX does not trace a function again
  while its trace is cached, so call ``jax.clear_caches()`` first.
  """
  calls: list[Call] = []
  token = _calls.set(calls)
  try:
    yield calls
  finally:
    _calls.reset(token)


def record(op: str, *, x_shape, w_shape, dtype, axis_size: int, axis: int,
           axis_name: str, schedule: schedule_lib.Schedule,
           source: str) -> None:
  """Adds one call to the innermost `recording` block, if any."""
  calls = _calls.get()
  if calls is None:
    return
  site = Site(op=op, x_shape=tuple(int(d) for d in x_shape),
              w_shape=tuple(int(d) for d in w_shape),
              dtype=np.dtype(dtype).name, axis_size=int(axis_size),
              axis=int(axis), axis_name=str(axis_name),
              device_kind=devices.device_kind())
  calls.append(Call(site=site, schedule=schedule, source=source))

