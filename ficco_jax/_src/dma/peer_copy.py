"""The three peer-copy primitives (xla_ffi/PROTOCOL.md), used inside shard_map.

``start`` issues every copy of a GatherPlan on the copy engines and returns the
landing buffers at once; ``wait`` makes compute wait for one landing buffer;
``done`` holds the buffers peers still read until every rank's copies have
finished. Each is a JAX primitive lowered to an XLA FFI custom call; the same
targets run on CPU (the twin in xla_ffi/cpu_peer_copy.cc) and CUDA.

Usage (inside ``shard_map``, manual over ``axis_name``)::

  landing = start([x], plan, axis_name="x", op_name=..., timeout_s=...)
  bufs = []
  for b, buf in enumerate(landing):
    buf = wait(buf, ...)          # order waits with lax.optimization_barrier
    bufs.append(buf)              # ... consume buf ...
  out = done(out, [x, *(bufs[b] for b in plan.forwarded_landings)], ...)

Pass each landing buffer, unchanged, to exactly one ``wait``; keep alive in
``done`` the sources (``keepalive[0]`` must be ``sources[0]``) and the *wait
outputs* of ``plan.forwarded_landings`` (never the start outputs: a second
consumer of a buffer still being filled makes XLA copy it early). ``done``'s
result must be used, or XLA drops the wait for the peers' copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ficco_jax._src.dma import library
from ficco_jax._src.plan import GatherPlan

_START, _WAIT, _DONE = ("ficco_peer_copy_start", "ficco_peer_copy_wait",
                         "ficco_peer_copy_done")

# A fresh id per traced start: the rendezvous key tells apart call sites of
# one program, and messages name it.
_sites = itertools.count()


def _timeout_ms(timeout_s: float) -> int:
  if not timeout_s > 0:
    raise ValueError(f"{timeout_s=} must be > 0.")
  return max(1, int(round(timeout_s * 1000)))


def start(sources: Sequence[jax.Array], plan: GatherPlan, *, axis_name: str,
          op_name: str, timeout_s: float) -> list[jax.Array]:
  """Issues every transfer of ``plan``; returns the landing buffers at once.

  Args:
    sources: this rank's source operands, ``[R, *row]`` each with a common
      dtype and row shape; ``sources[0]`` is the local shard
      (``R == plan.shard_rows``).
    plan: the transfers, relative to the executing rank.
    axis_name: the manual mesh axis gathered over.
    op_name: named in error messages.
    timeout_s: bound of every host wait for peers.

  Returns:
    Landing buffer ``b`` of shape ``[plan.landing_rows[b], *row]``, being
    filled by the copy engines until its ``wait``.
  """
  sources = list(sources)
  if not sources:
    raise ValueError("start needs at least one source operand.")
  first = sources[0]
  if first.ndim < 1:
    raise ValueError(f"sources must have a row dimension; got {first.shape=}.")
  for i, s in enumerate(sources):
    if s.dtype != first.dtype or s.shape[1:] != first.shape[1:]:
      raise ValueError(
          f"sources must share dtype and trailing dims: sources[{i}] is"
          f" {s.dtype}{list(s.shape)}, sources[0] is"
          f" {first.dtype}{list(first.shape)}.")
  if first.shape[0] != plan.shard_rows:
    raise ValueError(
        f"sources[0] has {first.shape[0]} rows but {plan.shard_rows=}.")
  if plan.axis_size == 1 or not plan.transfers:
    # Nothing moves, and without a landing buffer nothing would order done
    # after start: the caller skips the peer copy altogether.
    raise ValueError(
        f"{plan.axis_size=}: a plan with no transfers needs no peer copy;"
        " skip start/wait/done.")
  axis_size = jax.lax.axis_size(axis_name)
  if plan.axis_size != axis_size:
    raise ValueError(
        f"{plan.axis_size=} differs from the size {axis_size} of axis"
        f" {axis_name!r}.")
  out = _start_p.bind(*sources, plan=plan, axis_name=axis_name,
                      op_name=op_name, timeout_ms=_timeout_ms(timeout_s),
                      site=next(_sites))
  return list(out)


def wait(buf: jax.Array, *, op_name: str, timeout_s: float) -> jax.Array:
  """Makes compute wait for the copies into one landing buffer.

  Returns ``buf`` itself (aliased in place), complete.
  """
  return _wait_p.bind(buf, op_name=op_name, timeout_ms=_timeout_ms(timeout_s))


def done(out: jax.Array, keepalive: Sequence[jax.Array], *, op_name: str,
         timeout_s: float) -> jax.Array:
  """Ends an invocation: returns ``out`` (aliased) once every rank's copies
  have finished, so the buffers in ``keepalive`` may be reused afterwards.

  ``keepalive[0]`` must be the ``sources[0]`` given to start; the wait
  outputs of the plan's forwarded landing buffers must be in it too.
  """
  keepalive = list(keepalive)
  if not keepalive:
    raise ValueError("done needs keepalive[0] = the sources[0] given to start.")
  return _done_p.bind(out, *keepalive, op_name=op_name,
                      timeout_ms=_timeout_ms(timeout_s))


# --- abstract evaluation ----------------------------------------------------


def _start_abstract_eval(*sources, plan, axis_name, **_):
  del axis_name
  first = sources[0]
  return [first.update(shape=(rows,) + tuple(first.shape[1:]))
          for rows in plan.landing_rows]


_start_p = Primitive("ficco_peer_copy_start")
_start_p.multiple_results = True
_start_p.def_abstract_eval(_start_abstract_eval)

_wait_p = Primitive("ficco_peer_copy_wait")
_wait_p.def_abstract_eval(lambda buf, **_: buf)

_done_p = Primitive("ficco_peer_copy_done")
_done_p.def_abstract_eval(lambda out, *keepalive, **_: out)


# --- lowering ---------------------------------------------------------------


def _concrete_mesh(ctx: mlir.LoweringRuleContext, axis_name: str):
  """The physical mesh the program is lowered for.

  The copies need device ordinals, but inside shard_map the jaxpr only knows
  axis names and sizes: the concrete mesh is visible solely to the lowering,
  as the module's SPMD axis context (jit + shard_map over a jax.sharding.Mesh).
  """
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(
        "comm='dma' must be lowered inside jit(shard_map(...)) over a concrete"
        f" jax.sharding.Mesh (got {type(mesh).__name__}); use comm='xla'.")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{axis_name=} is not an axis of {mesh.axis_names}.")
  return mesh


def _devices_table(mesh, axis_name: str) -> np.ndarray:
  """Device ordinals, group-major, rank-minor (rank = position on the axis,
  group = position along the other axes), of the groups in this process."""
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), -1)
  groups = devices.reshape(-1, devices.shape[-1])
  here = jax.process_index()
  local = [g for g in groups if any(d.process_index == here for d in g)]
  if not local or any(d.process_index != here for g in local for d in g):
    raise ValueError(
        f"comm='dma' needs every device of axis {axis_name!r} in this process;"
        " use comm='xla'.")
  return np.asarray([[d.local_hardware_id for d in g] for g in local],
                    np.int64).reshape(-1)


def _start_lowering(ctx, *sources, plan: GatherPlan, axis_name: str,
                    op_name: str, timeout_ms: int, site: int):
  library.ensure_registered()
  mesh = _concrete_mesh(ctx, axis_name)

  def column(field):
    return np.asarray([getattr(t, field) for t in plan.transfers], np.int64)

  return jax.ffi.ffi_lowering(_START, has_side_effect=True)(
      ctx, *sources,
      devices=_devices_table(mesh, axis_name),
      axis_size=np.int64(plan.axis_size),
      dst=column("dst"), dst_row=column("dst_row"),
      src_offset=column("src_offset"), src=column("src"),
      src_row=column("src_row"), rows=column("rows"),
      stream=column("stream"),
      num_streams=np.int64(plan.num_streams),
      site=np.int64(site), op_name=op_name,
      timeout_ms=np.int64(timeout_ms))


def _wait_lowering(ctx, buf, *, op_name: str, timeout_ms: int):
  library.ensure_registered()
  return jax.ffi.ffi_lowering(_WAIT, operand_output_aliases={0: 0})(
      ctx, buf, op_name=op_name, timeout_ms=np.int64(timeout_ms))


def _done_lowering(ctx, out, *keepalive, op_name: str, timeout_ms: int):
  library.ensure_registered()
  return jax.ffi.ffi_lowering(
      _DONE, operand_output_aliases={0: 0}, has_side_effect=True)(
          ctx, out, *keepalive, op_name=op_name,
          timeout_ms=np.int64(timeout_ms))


for _platform in ("cpu", "cuda"):
  mlir.register_lowering(_start_p, _start_lowering, platform=_platform)
  mlir.register_lowering(_wait_p, _wait_lowering, platform=_platform)
  mlir.register_lowering(_done_p, _done_lowering, platform=_platform)
