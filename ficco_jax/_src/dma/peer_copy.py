"""The peer-copy primitives, used inside shard_map.

``start`` issues every copy of a GatherPlan on the copy engines and returns the
landing buffers at once; ``wait`` makes compute wait for one landing buffer;
``done`` holds the buffers peers still read until they may be reused; ``sync``
does any number of both in one call (``wait`` and ``done`` are its one-buffer
forms). Each is a JAX primitive lowered to XLA FFI custom calls of one of two
transports; the same targets run on CPU (twins in xla_ffi/cpu_*.cc) and CUDA:

* ``rendezvous`` (docs/protocol.md): ranks meet on the host per call and
  copy straight between XLA's buffers. Every device of the axis must be in
  this process. A sync is one custom call.
* ``window`` (docs/windows.md): each rank stages its sources in a window
  of memory every peer mapped once (peer access, CUDA IPC or shared memory)
  and ranks synchronise through flags in the windows, with no host wait. It
  works across the processes of one host. A sync lowers to one wait or done
  call per buffer or invocation.

Each primitive takes the op's ``transport`` (`Schedule.transport`: None,
``"rendezvous"`` or ``"window"``); None resolves when the op is lowered over
its concrete mesh: the window transport when the axis spans processes, else
rendezvous (`schedule.resolve_transport`).

Usage (inside ``shard_map``, manual over ``axis_name``)::

  site = new_site()
  kw = dict(axis_name="x", op_name=..., timeout_s=..., transport=None)
  landing = start([x], plan, site=site, **kw)
  bufs = []
  for b, buf in enumerate(landing):
    buf = wait(buf, site=site, **kw)  # order waits with
    bufs.append(buf)                  # optimization_barrier; consume buf ...
  out = done(out, [x, *(bufs[b] for b in plan.forwarded_landings)],
             site=site, **kw)

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
from jax import lax
import numpy as np
from jax.interpreters import mlir

from ficco_jax._src import plan as plan_lib
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import vma
from ficco_jax._src.dma import attrs
from ficco_jax._src.dma import library
from ficco_jax._src.dma import primitives
from ficco_jax._src.dma import windows
from ficco_jax._src.plan import GatherPlan

# start, then how waits and dones lower: the rendezvous transport has one
# sync target that does any number of both in one call; the window
# transport one target each, one call per landing buffer or invocation.
_TARGETS = {
    "rendezvous": ("ficco_peer_copy_start", "ficco_peer_copy_sync"),
    "window": ("ficco_window_start", "ficco_window_wait", "ficco_window_done"),
}

# A fresh id per traced start: the rendezvous key tells apart call sites of
# one program, and messages name it.
_sites = itertools.count()


def new_site() -> int:
  """A fresh call-site id: one per start, shared with its waits and done."""
  return next(_sites)


def arm(like: jax.Array, num_flags: int, plan: GatherPlan, *,
        axis_name: str, site: int, op_name: str, dtype,
        row_shape: tuple[int, ...], transport: str | None = None
        ) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
  """Before a flagged start's kernel: zeroed flags, the rank, the landings.

  A flagged start (``start(..., flags=...)``) lets each copy begin when the
  kernel that writes its source rows bumps their completion flag to the
  target, not when the kernel ends. ``arm`` runs before that kernel, on the
  compute stream: it zeroes ``num_flags`` int32 flags and marks the point
  after which the landing buffers, which it returns, are free to be written
  (docs/protocol.md, "Flagged starts"). Pass the flags (through the kernel)
  and the landing buffers, untouched, to the start of ``site``; the start
  checks that they are the same buffers. It also writes this device's rank
  along ``axis_name``, for the kernel: the handler knows it, and a
  ``lax.axis_index`` would cost the program two more steps per call (XLA's
  partition-id and a fusion converting it).

  Args:
    like: any value varying over ``axis_name`` (it types the landing
      buffers; not read). The flags are typed invariant, as jax >= 0.11
      requires of a buffer a Pallas kernel writes in place.
    num_flags: flags the kernel bumps (one per piece it hands over).
    plan: the start's plan (its landing buffers).
    axis_name, site, op_name, transport: as for `start` (flagged starts
      run the rendezvous transport only).
    dtype, row_shape: the landing buffers' dtype and trailing dims.

  Returns:
    (flags ``int32[num_flags]``, the rank ``int32[]`` (varying over
    ``axis_name``, equal to ``lax.axis_index(axis_name)``), landing buffers
    as `start` returns them).
  """
  if isinstance(num_flags, bool) or not isinstance(num_flags, int) or (
      num_flags < 1):
    raise ValueError(f"num_flags={num_flags!r} must be a positive int.")
  out = _arm_p.bind(np.int32(0), like, num_flags=num_flags,
                    landing_rows=tuple(plan.landing_rows),
                    dtype=np.dtype(dtype), row_shape=tuple(row_shape),
                    axis_name=axis_name, site=site, op_name=op_name,
                    transport=transport)
  # The rank differs per device: typed varying over the axis whatever
  # `like` is typed (the abstract eval copies `like`'s type).
  rank = out[1]
  if axis_name not in vma.varying_axes(rank):
    rank = lax.pcast(rank, (axis_name,), to="varying")
  return out[0], rank, list(out[2:])


def start(sources: Sequence[jax.Array], plan: GatherPlan, *, axis_name: str,
          site: int, op_name: str, timeout_s: float,
          transport: str | None = None,
          flags: jax.Array | None = None,
          landings: Sequence[jax.Array] | None = None,
          flag_target: int = 0,
          src_flags: Sequence[int] | None = None,
          landed: bool = False) -> list[jax.Array]:
  """Issues every transfer of ``plan``; returns the landing buffers at once.

  Args:
    sources: this rank's source operands, ``[R, *row]`` each with a common
      dtype and row shape; ``sources[0]`` is the local shard
      (``R == plan.shard_rows``).
    plan: the transfers, relative to the executing rank.
    axis_name: the manual mesh axis gathered over.
    site: this call site's id (`new_site`); its waits and done take it too.
    op_name: named in error messages.
    timeout_s: bound of every host wait for peers.
    transport: `Schedule.transport` (None: automatic); its waits and done
      take the same.
    flags: flagged starts only: ``arm``'s flags, as the kernel that writes
      the sources returned them (bumped in place). Transfer ``i`` then reads
      its source rows once the source rank's ``flags[src_flags[i]]`` reaches
      ``flag_target``, which may be long before this start runs.
    landings: with ``flags``: ``arm``'s landing buffers (returned aliased).
    flag_target: with ``flags``: a flag's value once its rows are complete.
    src_flags: with ``flags``: per transfer of ``plan``, the flag of its
      source rows.
    landed: window transport only: also return ``int32[len(plan.transfers)]``
      landing flags, zeroed by this start on the compute stream; transfer
      ``i``'s copy queue sets flag ``i`` to 1 once its rows have landed, so
      a kernel may wait on the device for exactly the piece it reads
      (`chunk_matmul.chunk_matmul_pieces`'s ``landed``). Each landing
      buffer still takes its ``wait``: a ``landed`` one before such a
      kernel (it only orders the kernel after the flags' writes are
      enqueued), a plain one where the consumer cannot wait on a flag (an
      interpreted kernel). ``done`` still ends the invocation; keep the
      flags alive in its ``keepalive`` (the queues write them until then).
      Should the invocation fail, every flag is set all the same (on
      CUDA), so that no kernel waits for ever; its ``wait`` or ``done``, or
      the next call, reports the failure.

  Returns:
    Landing buffer ``b`` of shape ``[plan.landing_rows[b], *row]``, being
    filled by the copy engines until its ``wait``; then, with ``landed``,
    the landing flags.
  """
  extra = []
  if flags is not None:
    src_flags = tuple(int(f) for f in (src_flags or ()))
    if len(src_flags) != len(plan.transfers):
      raise ValueError(f"src_flags has {len(src_flags)} entries for"
                       f" {len(plan.transfers)} transfers: one per transfer.")
    if flags.ndim != 1 or flags.dtype != np.int32:
      raise ValueError(f"flags must be int32[num_flags], got {flags.dtype}"
                       f"{list(flags.shape)}.")
    if not all(0 <= f < flags.shape[0] for f in src_flags):
      raise ValueError(f"src_flags={src_flags} must index flags"
                       f" ({flags.shape[0]} of them).")
    if isinstance(flag_target, bool) or not isinstance(flag_target, int) or (
        flag_target < 1):
      raise ValueError(f"flag_target={flag_target!r} must be a positive int.")
    landings = list(landings or ())
    if len(landings) != len(plan.landing_rows):
      raise ValueError(f"landings has {len(landings)} buffers; the plan has"
                       f" {len(plan.landing_rows)}.")
    extra = [flags, *landings]
  elif landings is not None or src_flags is not None or flag_target:
    raise ValueError("landings, src_flags and flag_target need flags.")
  if landed and flags is not None:
    raise ValueError("landed flags are the window transport's; flagged"
                     " starts (flags=...) run the rendezvous transport.")
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
  out = _start_p.bind(*sources, *extra, plan=plan, axis_name=axis_name,
                      op_name=op_name, timeout_ms=primitives.timeout_ms(timeout_s),
                      site=site, num_sources=len(sources),
                      transport=transport,
                      flag_target=int(flag_target) if extra else 0,
                      src_flags=src_flags if extra else None,
                      landed=bool(landed))
  return list(out)


def wait(buf: jax.Array, *, axis_name: str, site: int, op_name: str,
         timeout_s: float, transport: str | None = None,
         landed: bool = False) -> jax.Array:
  """Makes compute wait for the copies into one landing buffer.

  ``axis_name``, ``site`` and ``transport`` are the start's (they pick its
  transport and windows). Returns ``buf`` itself (aliased in place),
  complete; with ``landed`` (a start with landing flags, window transport)
  not yet complete: the call returns once the copies into it and their
  landing-flag writes are enqueued, and enqueues no device wait, for a
  kernel after it that waits on the flags on the device (a wait enqueued
  before the write it waits for could deadlock the GPU's queues:
  docs/windows.md, "Landing flags").
  """
  return sync([(buf, site)], [], axis_name=axis_name, op_name=op_name,
              timeout_s=timeout_s, transport=transport, landed=landed)[0]


def done(out: jax.Array, keepalive: Sequence[jax.Array], *, axis_name: str,
         site: int, op_name: str, timeout_s: float,
         transport: str | None = None) -> jax.Array:
  """Ends an invocation: returns ``out`` (aliased) once every rank's copies
  have finished, so the buffers in ``keepalive`` may be reused afterwards.

  ``keepalive[0]`` must be the ``sources[0]`` given to start; the wait
  outputs of the plan's forwarded landing buffers must be in it too.
  """
  keepalive = list(keepalive)
  if not keepalive:
    raise ValueError("done needs keepalive[0] = the sources[0] given to start.")
  return sync([], [(keepalive, site)], out=out, axis_name=axis_name,
              op_name=op_name, timeout_s=timeout_s, transport=transport)[0]


def sync(landings: Sequence[tuple[jax.Array, int]],
         ends: Sequence[tuple[Sequence[jax.Array], int]], *,
         axis_name: str, op_name: str, timeout_s: float,
         transport: str | None = None,
         out: jax.Array | None = None,
         landed: bool = False) -> list[jax.Array]:
  """Several waits and dones in one call (one FFI call on the rendezvous
  transport, where each call costs the host ~10 us on a short op).

  Args:
    landings: ``(landing buffer, its start's site)`` pairs to wait for, each
      buffer given unchanged, as to `wait`.
    ends: ``(keepalive, site)`` per invocation to end, as to `done`. An
      invocation must be ordered after its start by data, since runtimes
      that run independent custom calls concurrently (XLA:CPU) see nothing
      else: wait for one of its landing buffers in this same sync, or keep
      alive a buffer computed from one.
    axis_name: the manual mesh axis of the starts.
    op_name: named in error messages.
    timeout_s: bound of every host wait for peers.
    transport: the starts' transport.
    out: an extra array returned aliased after everything, as `done`'s
      ``out``; needed when ``landings`` is empty.
    landed: the waits are `wait`'s ``landed`` ones (window transport).

  Returns:
    The landing buffers (complete), then ``out`` if given. Use them: they
    order what follows after the waits and dones (a sync that ends nothing
    has no side effect, and XLA drops it when its results go unused).
  """
  outs = [b for b, _ in landings] + ([] if out is None else [out])
  if not outs:
    raise ValueError("sync needs a landing buffer or `out` to return.")
  keep, bounds = [], [len(outs)]
  for i, (group, _) in enumerate(ends):
    group = list(group)
    if not group:
      raise ValueError(f"ends[{i}] keeps nothing alive; its first buffer must"
                       " be the sources[0] given to start.")
    keep += group
    bounds.append(bounds[-1] + len(group))
  return list(_sync_p.bind(
      *outs, *keep, num_wait=len(landings), keep_bounds=tuple(bounds),
      wait_sites=tuple(s for _, s in landings),
      done_sites=tuple(s for _, s in ends), axis_name=axis_name,
      op_name=op_name, timeout_ms=primitives.timeout_ms(timeout_s),
      transport=transport, landed=bool(landed)))


# --- abstract evaluation ----------------------------------------------------


def _start_abstract_eval(*sources, plan, axis_name, landed, **_):
  del axis_name
  first = sources[0]
  outs = [first.update(shape=(rows,) + tuple(first.shape[1:]))
          for rows in plan.landing_rows]
  if landed:
    outs.append(first.update(shape=(len(plan.transfers),),
                             dtype=np.dtype(np.int32)))
  return outs


def _arm_abstract_eval(flags_like, like, *, num_flags, landing_rows, dtype,
                       row_shape, **_):
  return [flags_like.update(shape=(num_flags,), dtype=np.dtype(np.int32)),
          like.update(shape=(), dtype=np.dtype(np.int32))] + [
      like.update(shape=(rows,) + tuple(row_shape), dtype=dtype)
      for rows in landing_rows]


_arm_p = primitives.primitive("ficco_flags_arm")
_arm_p.def_abstract_eval(_arm_abstract_eval)

_start_p = primitives.primitive("ficco_peer_copy_start")
_start_p.def_abstract_eval(_start_abstract_eval)

_sync_p = primitives.primitive("ficco_peer_copy_sync")
_sync_p.def_abstract_eval(
    lambda *args, keep_bounds, **_: list(args[:keep_bounds[0]]))


# --- lowering ---------------------------------------------------------------


def _resolve(mesh, axis_name: str, requested: str | None) -> str:
  """The transport a lowering over ``mesh`` uses for `Schedule.transport`
  ``requested`` (`schedule.resolve_transport`)."""
  kind = schedule_lib.resolve_transport(
      requested, flagged=False,
      spans_processes=windows.spans_processes(mesh, axis_name))
  if kind not in _TARGETS:
    raise ValueError(f"transport={kind!r} does not carry peer copies; it"
                     f" takes one of {tuple(_TARGETS)}.")
  return kind


def _devices_table(mesh, axis_name: str, *, local: bool) -> np.ndarray:
  """Devices of the groups in this process, group-major, rank-minor (rank =
  position on the axis, group = position along the other axes): local
  ordinals (rendezvous; every device must be here) or global ids (window)."""
  here = jax.process_index()
  groups = [g for g in windows.axis_groups(mesh, axis_name)
            if any(d.process_index == here for d in g)]
  if local:
    return np.asarray([[d.local_hardware_id for d in g] for g in groups],
                      np.int64).reshape(-1)
  return np.asarray([[d.id for d in g] for g in groups], np.int64).reshape(-1)


def _arm_lowering(ctx, *likes, site: int, op_name: str, axis_name: str,
                  transport: str | None, **_):
  library.ensure_registered()
  mesh = primitives.concrete_mesh(ctx, axis_name)
  if _resolve(mesh, axis_name, transport) != "rendezvous":
    raise ValueError(
        "The flagged reduce-scatter's rendezvous transport needs every"
        " device of the axis in this process; use Schedule(transport=None)"
        " (push, which runs across processes) or another"
        " compute_granularity.")
  return attrs.lower("ficco_flags_arm", ctx, *likes, site=site,
                     op_name=op_name,
                     devices=_devices_table(mesh, axis_name, local=True),
                     axis_size=mesh.shape[axis_name])


def _start_lowering(ctx, *sources, plan: GatherPlan, axis_name: str,
                    op_name: str, timeout_ms: int, site: int,
                    num_sources: int, flag_target: int, src_flags,
                    transport: str | None, landed: bool):
  library.ensure_registered()
  mesh = primitives.concrete_mesh(ctx, axis_name)
  kind = _resolve(mesh, axis_name, transport)
  extra = {}
  if landed:
    if kind != "window":
      raise ValueError(
          f"Landing flags need the window transport; this start resolved"
          f" transport={kind!r} (Schedule.transport={transport!r}).")
    if len(plan_lib.owner_pulls(plan).transfers) != len(plan.transfers):
      raise ValueError("Landing flags need a plan whose transfers the window"
                       " transport pulls as they are (no forwarding).")
    extra["landed"] = 1
  aliases = {}
  if src_flags is not None:
    if kind != "rendezvous":
      raise ValueError("Flagged starts need the rendezvous transport.")
    # Operands: sources, flags, then arm's landing buffers, returned aliased.
    extra.update(src_flag=src_flags,
                 num_flags=ctx.avals_in[num_sources].shape[0],
                 flag_target=flag_target)
    aliases = {num_sources + 1 + b: b for b in range(len(plan.landing_rows))}
  elif kind == "rendezvous":
    extra.update(src_flag=np.full(len(plan.transfers), -1, np.int64))
  if kind == "window":
    if num_sources != 1:
      # The handlers find a done's invocation by its first source: two
      # pending starts of one execution may share it, which is harmless
      # only when it is their only source (window_protocol.h, WindowIndex).
      raise ValueError(
          f"The window transport takes one source per start, got"
          f" {num_sources}; concatenate them, or use"
          f" Schedule(transport='rendezvous').")
    # Every piece comes from its owner's window (no forwarding), and the
    # window must hold this rank's sources.
    plan = plan_lib.owner_pulls(plan)
    align = lambda n: -(-n // 256) * 256
    slot = sum(align(int(np.prod(a.shape)) * a.dtype.itemsize)
               for a in ctx.avals_in)
    fam = windows.family_for(mesh, axis_name, site=site, slot_bytes=slot,
                             platform=primitives.platform_of(ctx),
                             program=_program(ctx),
                             name=primitives.program_name(ctx))
    extra["window"] = fam.id

  def column(field):
    return np.asarray([getattr(t, field) for t in plan.transfers], np.int64)

  return attrs.lower(
      _TARGETS[kind][0], ctx, *sources, operand_output_aliases=aliases or None,
      devices=_devices_table(mesh, axis_name, local=kind == "rendezvous"),
      axis_size=plan.axis_size,
      dst=column("dst"), dst_row=column("dst_row"),
      src_offset=column("src_offset"), src=column("src"),
      src_row=column("src_row"), rows=column("rows"),
      stream=column("stream"), num_streams=plan.num_streams,
      site=site, op_name=op_name, timeout_ms=timeout_ms, **extra)


def _program(ctx) -> dict:
  return primitives.program_state(ctx, ("ficco_jax", "window sites"))


def _window_of(ctx, mesh, axis_name: str, site: int) -> dict:
  """The window family a window wait or done of ``site`` syncs on."""
  fam = windows.program_family(mesh, axis_name, site=site,
                               platform=primitives.platform_of(ctx),
                               program=_program(ctx), first="start",
                               later="waits and done")
  return {"window": fam.id}


def _sync_lowering(ctx, *args, num_wait: int, keep_bounds: tuple[int, ...],
                   wait_sites: tuple[int, ...], done_sites: tuple[int, ...],
                   axis_name: str, op_name: str, timeout_ms: int,
                   transport: str | None, landed: bool):
  library.ensure_registered()
  mesh = primitives.concrete_mesh(ctx, axis_name)
  kind = _resolve(mesh, axis_name, transport)
  num_outs = keep_bounds[0]
  common = dict(op_name=op_name, timeout_ms=timeout_ms)
  if landed and kind != "window":
    raise ValueError(f"Landed waits need the window transport; this sync"
                     f" resolved transport={kind!r}.")
  if kind == "rendezvous":
    return attrs.lower(
        _TARGETS[kind][1], ctx, *args, has_side_effect=bool(done_sites),
        operand_output_aliases={i: i for i in range(num_outs)},
        num_wait=num_wait, keep_bounds=keep_bounds, **common)
  # Window transport: one wait per landing buffer, then one done per
  # invocation, threaded through the last out (aliased, so no copies).
  outs = list(args[:num_outs])
  avals = list(ctx.avals_in[:num_outs])

  def call(target, operands, operand_avals, site):
    extra = _window_of(ctx, mesh, axis_name, site)
    if landed and target.endswith("wait"):
      extra["landed"] = 1
    sub = ctx.replace(avals_in=operand_avals, avals_out=[operand_avals[0]])
    return attrs.lower(target, sub, *operands, operand_output_aliases={0: 0},
                       has_side_effect=target.endswith("done"), **common,
                       **extra)[0]

  for i, site in enumerate(wait_sites):
    outs[i] = call(_TARGETS[kind][1], [outs[i]], [avals[i]], site)
  # Every done also reads every waited buffer of this sync: a runtime that
  # orders custom calls by the buffers they touch (XLA:CPU runs independent
  # thunks concurrently, and an optimization barrier orders nothing once it
  # is compiled away) must run a done after the start it ends, which wrote
  # one of those buffers; the handler reads only keepalive[0].
  others = [i for i in range(num_wait) if i != num_outs - 1]
  for g, site in enumerate(done_sites):
    lo, hi = keep_bounds[g], keep_bounds[g + 1]
    outs[-1] = call(
        _TARGETS[kind][2],
        [outs[-1], *args[lo:hi], *(outs[i] for i in others)],
        [avals[-1], *ctx.avals_in[lo:hi], *(avals[i] for i in others)], site)
  return outs


for _platform in ("cpu", "cuda"):
  mlir.register_lowering(_arm_p, _arm_lowering, platform=_platform)
  mlir.register_lowering(_start_p, _start_lowering, platform=_platform)
  mlir.register_lowering(_sync_p, _sync_lowering, platform=_platform)
