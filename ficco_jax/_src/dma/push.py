"""The push protocol (docs/windows.md, "Push"): the flagged reduce-scatter
and the push all-gather matmul (`gather`).

Each rank's copy engines push its partials straight from XLA's buffer into
the window of the rank that owns those rows, each piece once the kernel's
flag says it is written; the owner adds them to its own rows from its
window. Unlike the rendezvous transport's flagged start, no host thread
waits for a peer's (only, rarely, for a peer two calls behind), and the sum
is the finish's own kernel instead of an XLA fusion after a sync: two fewer
host steps per call, for ops whose host time shows (docs/protocol.md,
"Flagged starts").

Usage (inside ``shard_map``, manual over ``axis_name``)::

  site = peer_copy.new_site()
  flags, rank = arm(like, num_flags, half_bytes, axis_name=..., site=site, ...)
  parts, flags, target = kernel(..., flags, rank)   # bumps flags in place
  flags = start(parts, flags, pieces, flag_target=target, site=site, ...)
  out = finish(parts, flags, own_row=..., chunk_rows=..., num_chunks=...,
               site=site, ...)

Piece ``(shift, src_row, dst_row, rows, flag)``: rows ``[src_row, +rows)`` of
``parts`` go to rank ``(rank + shift) % P``, at row ``dst_row`` of its
landing half, once ``flags[flag]`` reaches the target. ``finish`` returns
rows ``[own_row, + num_chunks chunk_rows)`` of ``parts`` plus the landed
pieces, which must be laid out chunk-major, ``P - 1`` per chunk in shift
order (``dst_row = (j (P - 1) + s - 1) chunk_rows``), as the flagged kernel
orders them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.interpreters import mlir

from ficco_jax._src.dma import attrs
from ficco_jax._src.dma import library
from ficco_jax._src.dma import primitives
from ficco_jax._src.dma import windows

# (shift, src_row, dst_row, rows, flag)
Piece = tuple[int, int, int, int, int]


def half_bytes(rows: int, row_bytes: int) -> int:
  """Bytes of one landing half of ``rows`` rows (aligned as window slots)."""
  return -(-rows * row_bytes // 256) * 256


def arm(like: jax.Array, num_flags: int, half: int, *, axis_name: str,
        site: int, op_name: str) -> tuple[jax.Array, jax.Array]:
  """Before the kernel: ``num_flags`` zeroed int32 flags and the rank.

  Lowering gives the site windows (two landing halves of at least ``half``
  bytes per device) from a pool: the k-th push site of every program shares
  the k-th pooled window (`windows.pooled_family`).

  Args:
    like: a value varying over ``axis_name`` that the op's kernel reads
      (types the rank, and orders the arm after it; not read).
    num_flags: flags the kernel bumps (one per piece it writes).
    half: bytes of a landing half (`half_bytes`).
    axis_name, site, op_name: the gathered axis, the call site
      (`peer_copy.new_site`), the op's name for messages.

  Returns:
    (flags ``int32[num_flags]``, typed invariant as a buffer a Pallas kernel
    writes in place must be; the rank ``int32[]``, varying over
    ``axis_name``, equal to ``lax.axis_index(axis_name)``).
  """
  if isinstance(num_flags, bool) or not isinstance(num_flags, int) or (
      num_flags < 1):
    raise ValueError(f"num_flags={num_flags!r} must be a positive int.")
  if not isinstance(half, int) or half < 1:
    raise ValueError(f"half={half!r} must be a positive int of bytes.")
  flags, rank = _arm_p.bind(np.int32(0), like, num_flags=num_flags, half=half,
                            axis_name=axis_name, site=site, op_name=op_name)
  return flags, rank


def start(parts: jax.Array, flags: jax.Array, pieces: Sequence[Piece], *,
          flag_target: int, half: int, axis_name: str, site: int,
          op_name: str, timeout_s: float) -> jax.Array:
  """Enqueues every piece's push; returns ``flags`` (aliased), for `finish`.

  Args:
    parts: the kernel's result (rows of ``row_bytes`` each).
    flags: the kernel's flags, as it returned them (in place).
    pieces: ``(shift, src_row, dst_row, rows, flag)`` per piece, in the
      order the kernel writes them.
    flag_target: the value a flag reaches once its piece is written.
    half, axis_name, site, op_name: as for `arm`.
    timeout_s: bound of every wait for a peer.

  Returns:
    ``flags``, to pass to `finish` (which keeps them alive while the copy
    engines still read them).
  """
  pieces = tuple(tuple(int(v) for v in p) for p in pieces)
  if not pieces or any(len(p) != 5 for p in pieces):
    raise ValueError(f"pieces={pieces!r} must be non-empty (shift, src_row,"
                     " dst_row, rows, flag) tuples.")
  return _start_p.bind(parts, flags, pieces=pieces,
                       flag_target=int(flag_target), half=half,
                       axis_name=axis_name, site=site, op_name=op_name,
                       timeout_ms=primitives.timeout_ms(timeout_s))


def finish(parts: jax.Array, flags: jax.Array, *, own_row: int,
           chunk_rows: int, num_chunks: int, half: int, axis_name: str,
           site: int, op_name: str, timeout_s: float) -> jax.Array:
  """This rank's result: its own rows plus every peer's pushed pieces.

  Args:
    parts: the kernel's result, as passed to `start`.
    flags: `start`'s result.
    own_row, chunk_rows, num_chunks: the own rows, ``[own_row, + num_chunks
      chunk_rows)`` of ``parts``, chunk by chunk.
    half, axis_name, site, op_name, timeout_s: as for `start`.

  Returns:
    ``[num_chunks chunk_rows, ...]`` of ``parts``'s dtype: chunk j is own
    chunk j plus the peers' pieces of chunk j, in shift order, added in
    float32 (float64 for float64) and rounded once.
  """
  return _finish_p.bind(parts, flags, own_row=int(own_row),
                        chunk_rows=int(chunk_rows), num_chunks=int(num_chunks),
                        half=half, axis_name=axis_name, site=site,
                        op_name=op_name,
                        timeout_ms=primitives.timeout_ms(timeout_s))


def gather(x: jax.Array, w: jax.Array, *, out_dtype, axis_size: int,
           axis_name: str, site: int, op_name: str, timeout_s: float,
           keep_gathered: bool = False
           ) -> tuple[jax.Array, jax.Array | None]:
  """``all_gather(x, tiled) @ w`` in one call (docs/windows.md, "Push
  all-gather").

  Each rank's copy engines push ``x`` into every peer's pooled window and
  flag its arrival there; the compute stream multiplies the own shard at
  once and each peer's where it landed, behind a device-side wait for that
  peer's flag, writing every product in place into its rows of the result.

  Args:
    x: this rank's rows, ``[m, k]``.
    w: ``[k, n]``, of ``x``'s dtype.
    out_dtype: the result's dtype: ``x``'s, or float32 for 16-bit inputs.
    axis_size: devices of ``axis_name``.
    axis_name, site, op_name: the gathered axis, the call site
      (`peer_copy.new_site`), the op's name for messages.
    timeout_s: bound of every wait for a peer.
    keep_gathered: also return the gathered ``x``, copied out of the window
      on the copy engines as each shard lands (a gradient's residual).

  Returns:
    ``(out, gathered)``: ``out`` ``[axis_size m, n]``, rank ``q``'s rows times
    ``w`` at rows ``[q m, + m)``, accumulated in float32 (float64 for
    float64) and rounded once; ``gathered`` ``[axis_size m, k]``, rank
    ``q``'s rows at ``[q m, + m)``, or None unless ``keep_gathered``.
  """
  half = half_bytes((axis_size - 1) * x.shape[0],
                    x.shape[1] * np.dtype(x.dtype).itemsize)
  out, gathered = _gather_p.bind(
      x, w, out_dtype=np.dtype(out_dtype), axis_size=int(axis_size),
      half=half, keep_gathered=bool(keep_gathered), axis_name=axis_name,
      site=site, op_name=op_name, timeout_ms=primitives.timeout_ms(timeout_s))
  return out, (gathered if keep_gathered else None)


# --- abstract evaluation ----------------------------------------------------


def _arm_abstract_eval(flags_like, like, *, num_flags, **_):
  return [flags_like.update(shape=(num_flags,), dtype=np.dtype(np.int32)),
          like.update(shape=(), dtype=np.dtype(np.int32))]


def _finish_abstract_eval(parts, flags, *, chunk_rows, num_chunks, **_):
  del flags
  return parts.update(shape=(num_chunks * chunk_rows,) + tuple(parts.shape[1:]))


def _gather_abstract_eval(x, w, *, out_dtype, axis_size, keep_gathered,
                          **_):
  # Not kept: an empty result, which the handler takes as "no copies".
  rows = axis_size * x.shape[0] if keep_gathered else 0
  return [x.update(shape=(axis_size * x.shape[0], w.shape[1]),
                   dtype=out_dtype),
          x.update(shape=(rows, x.shape[1]))]


_arm_p = primitives.primitive("ficco_push_arm")
_arm_p.def_abstract_eval(_arm_abstract_eval)

_start_p = primitives.primitive("ficco_push_start", multiple_results=False)
_start_p.def_abstract_eval(lambda parts, flags, **_: flags)

_finish_p = primitives.primitive("ficco_push_finish",
                                 multiple_results=False)
_finish_p.def_abstract_eval(_finish_abstract_eval)


_gather_p = primitives.primitive("ficco_push_gather")
_gather_p.def_abstract_eval(_gather_abstract_eval)


# --- lowering ---------------------------------------------------------------


_PROGRAM_KEY = ("ficco_jax", "push windows")


def _program(ctx) -> dict:
  return primitives.program_state(ctx, _PROGRAM_KEY)


def _family(ctx, axis_name: str, site: int, half: int, *, create: bool) -> int:
  mesh = primitives.concrete_mesh(ctx, axis_name)
  platform = primitives.platform_of(ctx)
  if create:
    return windows.pooled_family(mesh, axis_name, site=site,
                                 slot_bytes=2 * half, platform=platform,
                                 program=_program(ctx)).id
  return windows.program_family(mesh, axis_name, site=site, platform=platform,
                                program=_program(ctx), first="arm",
                                later="start and finish").id


def _arm_lowering(ctx, flags_like, like, *, half: int, axis_name: str,
                  site: int, op_name: str, **_):
  # `like` (the op's input) is an operand only to order the arm after it:
  # a later call of the site whose input depends on an earlier call's
  # result then arms only after that call's finish, as the protocol needs
  # (the handler never reads it).
  del flags_like  # Typing only.
  library.ensure_registered()
  window = _family(ctx, axis_name, site, half, create=True)
  return attrs.lower("ficco_push_arm", ctx.replace(avals_in=[ctx.avals_in[1]]),
                     like, window=window, op_name=op_name)


def _start_lowering(ctx, parts, flags, *, pieces, flag_target: int, half: int,
                    axis_name: str, site: int, op_name: str, timeout_ms: int):
  library.ensure_registered()
  window = _family(ctx, axis_name, site, half, create=False)
  column = lambda i: np.asarray([p[i] for p in pieces], np.int64)
  return attrs.lower(
      "ficco_push_start", ctx, parts, flags, operand_output_aliases={1: 0},
      window=window, op_name=op_name, timeout_ms=timeout_ms, shift=column(0),
      src_row=column(1), dst_row=column(2), rows=column(3),
      src_flag=column(4), flag_target=flag_target, half_bytes=half)


def _finish_lowering(ctx, parts, flags, *, own_row: int, chunk_rows: int,
                     num_chunks: int, half: int, axis_name: str, site: int,
                     op_name: str, timeout_ms: int):
  library.ensure_registered()
  window = _family(ctx, axis_name, site, half, create=False)
  return attrs.lower(
      "ficco_push_finish", ctx, parts, flags, window=window, op_name=op_name,
      timeout_ms=timeout_ms, own_row=own_row, chunk_rows=chunk_rows,
      num_chunks=num_chunks, half_bytes=half)


def _gather_lowering(ctx, x, w, *, half: int, axis_name: str, site: int,
                     op_name: str, timeout_ms: int, **_):
  library.ensure_registered()
  window = _family(ctx, axis_name, site, half, create=True)
  return attrs.lower("ficco_push_gather", ctx, x, w, window=window,
                     op_name=op_name, timeout_ms=timeout_ms, half_bytes=half)


for _platform in ("cpu", "cuda"):
  mlir.register_lowering(_arm_p, _arm_lowering, platform=_platform)
  mlir.register_lowering(_start_p, _start_lowering, platform=_platform)
  mlir.register_lowering(_finish_p, _finish_lowering, platform=_platform)
  mlir.register_lowering(_gather_p, _gather_lowering, platform=_platform)
