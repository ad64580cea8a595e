"""Chunk matmul that writes its product in place into rows of a larger output.

``chunk_matmul_into(out, x, w, row_offset)`` computes ``x [mc, K] @ w [K, n]``
and stores it into rows ``[row_offset, row_offset + mc)`` of ``out [M, n]``;
``out`` is aliased to the result (``input_output_aliases``), so XLA emits no
copy and no ``dynamic_update_slice`` after the kernel, and the other rows of
``out`` are left as they were. This is the compute step of the overlapped
collective matmuls: chunk ``c`` of the gathered operand is multiplied straight
into its place in the gathered output while chunk ``c + 1`` is still in flight.
`chunk_matmul`, `chunk_matmul_rows`, `chunk_matmul_pieces` and
`chunk_matmul_flagged` are the same kernels for a fresh result, rows read in
place, several row pieces in one launch, and pieces that signal a flag each.

This module holds the entry points: their argument checks, the choice of
kernel and the XLA `_reference`. Two kernels compute the product:

* the portable ``pl.pallas_call`` (`portable.py`), which runs under
  ``interpret=True`` on CPU;
* the Hopper kernel (`hopper.py`), Mosaic GPU, warp specialized and
  persistent; its constraints (bf16/f16, whole tiles, row offsets multiples
  of 8) are checked with a ValueError/TypeError naming the argument.

``interpret=None`` picks: interpret mode on CPU, the Hopper kernel on GPU.
The tile config, `pad_k` (`config.py`) and `ByRank` offsets (`offsets.py`)
are re-exported here, where the ops and benchmarks import them.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from ficco_jax._src import devices
from ficco_jax._src.pallas import config
from ficco_jax._src.pallas import hopper
from ficco_jax._src.pallas import portable
from ficco_jax._src.pallas.config import ChunkMatmulConfig as ChunkMatmulConfig
from ficco_jax._src.pallas.config import default_config as default_config
from ficco_jax._src.pallas.config import Dim as Dim
from ficco_jax._src.pallas.config import flag_target as flag_target
from ficco_jax._src.pallas.config import pad_k as pad_k
from ficco_jax._src.pallas.config import padded_k as padded_k
from ficco_jax._src.pallas.offsets import by_rank_offsets
from ficco_jax._src.pallas.offsets import ByRank as ByRank
from ficco_jax._src.pallas.offsets import offset_operand
from ficco_jax._src.pallas.offsets import piece_offsets
from ficco_jax._src.pallas.offsets import static_rows

# Dtypes the entry points take; the Hopper kernel's operands are 16-bit only.
_DTYPES = config.KERNEL_DTYPES


# ----------------------------------------------------------------------------
# Reference.


def _reference(out, x, w, row_offset):
  """XLA reference: f32-accumulated dot, then dynamic_update_slice into out."""
  y = lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                      preferred_element_type=jnp.float32)
  row_offset = jnp.asarray(row_offset, jnp.int32)
  return lax.dynamic_update_slice(out, y.astype(out.dtype),
                                  (row_offset, jnp.int32(0)))


# ----------------------------------------------------------------------------
# Validation.


def _check_args(out, x, w, row_offset, preferred_element_type):
  for name, a in (("out", out), ("x", x), ("w", w)):
    if getattr(a, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(a, 'shape', None)}.")
    if jnp.dtype(a.dtype) not in _DTYPES:
      raise TypeError(
          f"{name}.dtype={a.dtype} must be one of bfloat16, float16, float32.")
  mc, k = x.shape
  k2, n = w.shape
  m, n2 = out.shape
  if k != k2:
    raise ValueError(
        f"x.shape={x.shape} and w.shape={w.shape}: the contracting dimension"
        f" K must match ({k} != {k2}).")
  if n != n2:
    raise ValueError(
        f"out.shape={out.shape} must have w's {n} columns (w.shape={w.shape}).")
  if mc > m:
    raise ValueError(f"x has mc={mc} rows, more than out's M={m} rows.")
  if x.dtype != w.dtype:
    raise TypeError(f"x.dtype={x.dtype} and w.dtype={w.dtype} must match.")
  if (preferred_element_type is not None
      and jnp.dtype(preferred_element_type) != jnp.dtype(out.dtype)):
    raise TypeError(
        f"preferred_element_type={jnp.dtype(preferred_element_type)} must be"
        f" None or out.dtype={out.dtype}: the product is written into out.")
  if isinstance(row_offset, (int, np.integer)) and not isinstance(row_offset, bool):
    if not 0 <= row_offset <= m - mc:
      raise ValueError(
          f"row_offset={row_offset} with mc={mc} rows must lie in [0, {m - mc}]"
          f" so that rows [row_offset, row_offset + mc) fit in out's M={m}.")
  else:
    dt = getattr(row_offset, "dtype", None)
    if (isinstance(row_offset, bool) or dt is None
        or not jnp.issubdtype(dt, jnp.integer) or jnp.ndim(row_offset) != 0):
      raise TypeError(
          f"row_offset must be an int or an integer scalar array, got"
          f" {type(row_offset).__name__} with dtype={dt},"
          f" shape={getattr(row_offset, 'shape', None)}.")


def _check_num_sms(num_sms) -> None:
  if num_sms is not None and (
      isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
    raise ValueError(f"num_sms={num_sms!r} must be None or a positive int.")


def _check_int_scalar(label, r) -> None:
  """``r`` is an int or an integer scalar array (traced or not)."""
  if isinstance(r, (int, np.integer)) and not isinstance(r, bool):
    return
  dt = getattr(r, "dtype", None)
  if (isinstance(r, bool) or dt is None or jnp.ndim(r) != 0
      or not jnp.issubdtype(dt, jnp.integer)):
    raise TypeError(
        f"{label} must be an int or an integer scalar array, got"
        f" {type(r).__name__} with dtype={dt},"
        f" shape={getattr(r, 'shape', None)}.")


def _static_int(name, v) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{name} must hold static ints, got {v!r}"
                    f" ({type(v).__name__}).")
  return int(v)


def _check_addends(addends, addend_rows, rows, n) -> None:
  """Each addend holds ``rows`` rows of ``n`` columns from its first row."""
  if len(addend_rows) != len(addends):
    raise ValueError(f"addend_rows has {len(addend_rows)} entries, addends"
                     f" {len(addends)}: one per addend.")
  for i, (a, a0) in enumerate(zip(addends, addend_rows)):
    shape = getattr(a, "shape", None)
    if getattr(a, "ndim", None) != 2 or shape[1] != n:
      raise ValueError(f"addends[{i}].shape={shape} must be 2-D with w's {n}"
                       " columns.")
    if jnp.dtype(a.dtype) not in _DTYPES:
      raise TypeError(f"addends[{i}].dtype={a.dtype} must be one of"
                      " bfloat16, float16, float32.")
    if not 0 <= a0 <= shape[0] - rows:
      raise ValueError(
          f"addend_rows[{i}]={a0} with the result's {rows} rows must lie in"
          f" [0, {shape[0] - rows}] (addends[{i}].shape={shape}).")


def _check_piece_rows(name, offsets, rows, shape):
  """Each static offset keeps its ``rows`` rows inside ``shape``; traced
  ones must be integer scalars (their range is not checked)."""
  if isinstance(offsets, ByRank):
    _check_int_scalar(f"{name}.rank", offsets.rank)
    offsets = static_rows(offsets)
  for i, r in enumerate(offsets):
    if isinstance(r, (int, np.integer)) and not isinstance(r, bool):
      if not 0 <= r <= shape[0] - rows:
        raise ValueError(
            f"{name}[{i}]={r} with rows={rows} must lie in"
            f" [0, {shape[0] - rows}] so the piece fits in {shape[0]} rows"
            f" (shape {tuple(shape)}).")
      continue
    _check_int_scalar(f"{name}[{i}]", r)


# ----------------------------------------------------------------------------
# Entry points.


def _hopper_offset(row_offset) -> int | None:
  """Checks that the Hopper kernel can run here; the offset if static."""
  if devices.platform() != "gpu":
    raise ValueError(
        f"interpret=False needs a GPU (Hopper); this is traced for"
        f" {devices.platform()!r} devices. Use interpret=None or True.")
  return (int(row_offset) if isinstance(row_offset, (int, np.integer))
          else None)


def waits_in_kernel(interpret: bool | None = None) -> bool:
  """Whether a launch with these ``interpret`` settings runs the Hopper
  kernel, which can wait on landing flags (``chunk_matmul_pieces``'s
  ``landed``); an interpreted launch reads its operands as they are."""
  return not _resolve_interpret(interpret)


def _resolve_interpret(interpret: bool | None) -> bool:
  if interpret is None:
    return devices.platform() == "cpu"
  return bool(interpret)


def chunk_matmul_into(
    out: jax.Array,
    x: jax.Array,
    w: jax.Array,
    row_offset: int | jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
) -> jax.Array:
  """Writes ``x @ w`` into rows ``[row_offset, row_offset + mc)`` of ``out``.

  Args:
    out: ``[M, n]`` output buffer, bf16/f16/f32. Aliased to the result: rows
      outside the chunk keep their values, and XLA needs no copy when ``out``
      has no other reader (otherwise it inserts one before the kernel).
    x: ``[mc, K]`` chunk of the left operand, bf16/f16/f32.
    w: ``[K, n]`` right operand, same dtype as ``x``.
    row_offset: first row of the chunk inside ``out``; a Python int (checked:
      ``0 <= row_offset <= M - mc``) or an int32 scalar that may be traced
      (e.g. from ``lax.axis_index``; not checked: an out-of-range traced
      offset gives unspecified results). The Hopper kernel needs it to be a
      multiple of 8: checked when static; a traced offset that is not left
      rows unwritten on an H200 (the kernel tells the compiler the offset is
      8-aligned). Chunk offsets ``c * mc`` with the kernel's ``mc`` (a
      multiple of 64) always are.
    num_sms: Hopper kernel only: the most CTAs (one per SM) the persistent
      kernel launches; each loops over output tiles. None: all SMs. Time
      goes in whole waves of ``ceil(tiles / num_sms)`` tiles, so a value just
      under the tile count can double the time (e.g. 128 tiles on 112 SMs).
    preferred_element_type: None or ``out.dtype`` (accumulation is always
      f32; the result is rounded to ``out.dtype``).
    interpret: True runs the portable kernel in interpret mode; False compiles
      the Hopper kernel; None: interpret on CPU, compile on GPU.
    config: Hopper tile config; None: ``default_config(mc, K, n, ...,
      num_sms=num_sms or all SMs)``.

  Returns:
    ``[M, n]`` array of ``out.dtype``: ``out`` with the chunk's rows replaced.
  """
  _check_args(out, x, w, row_offset, preferred_element_type)
  _check_num_sms(num_sms)
  off = offset_operand(row_offset)
  if _resolve_interpret(interpret):
    return portable.portable_into(out, x, w, off, interpret=True)
  off_static = _hopper_offset(row_offset)
  return hopper.mgpu_into(out, x, w, off, num_sms=num_sms, config=config,
                         off_static=off_static)


def chunk_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
) -> jax.Array:
  """``x [mc, K] @ w [K, n]`` → ``[mc, n]`` through the same kernels.

  The output dtype is ``preferred_element_type`` (default ``x.dtype``). See
  ``chunk_matmul_into`` for the other arguments.
  """
  for name, a in (("x", x), ("w", w)):
    if getattr(a, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(a, 'shape', None)}.")
  dtype = jnp.dtype(preferred_element_type or x.dtype)
  out = jnp.zeros((x.shape[0], w.shape[1]), dtype)
  return chunk_matmul_into(out, x, w, 0, num_sms=num_sms,
                           preferred_element_type=dtype, interpret=interpret,
                           config=config)


def chunk_matmul_rows(
    x: jax.Array,
    row_offset: int | jax.Array,
    rows: int,
    w: jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
) -> jax.Array:
  """``x[row_offset : row_offset + rows] @ w`` → ``[rows, n]``, reading the
  rows in place.

  The reduce-scatter's pieces are row blocks of its left operand at offsets
  that depend on the rank; the Hopper kernel TMA-loads them straight from
  ``x`` (no slice copy) into a fresh output (no zero fill).

  Args:
    x: ``[M, K]`` left operand, bf16/f16/f32.
    row_offset: first row read; a Python int (checked: ``0 <= row_offset <=
      M - rows``) or a traced int32 scalar, a multiple of 8 on the Hopper
      path. A traced offset is not checked: out of range, the Hopper kernel
      reads zeros past the end of ``x`` where interpret mode clamps it.
    rows: rows read (a multiple of the CTA tile's rows on the Hopper path).
    w: ``[K, n]``, same dtype as ``x``.
    num_sms, preferred_element_type, interpret, config: as for
      ``chunk_matmul_into``.

  Returns:
    ``[rows, n]`` array of ``preferred_element_type`` (default ``x.dtype``).
  """
  # One piece of chunk_matmul_pieces (same checks, same kernel).
  return chunk_matmul_pieces(x, [row_offset], rows, w, num_sms=num_sms,
                             preferred_element_type=preferred_element_type,
                             interpret=interpret, config=config)


def chunk_matmul_pieces(
    x: jax.Array,
    x_rows: Sequence[int | jax.Array] | ByRank,
    rows: int,
    w: jax.Array,
    *,
    out: jax.Array | None = None,
    out_rows: Sequence[int | jax.Array] | ByRank | None = None,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
    x_zero_padded_k: bool = False,
    addends: Sequence[jax.Array] = (),
    addend_rows: Sequence[int] | None = None,
    fresh_rows: int | None = None,
    landed: tuple[jax.Array, Sequence[int]] | None = None,
    _flags: jax.Array | None = None,
    _flag_variant: tuple[str, str] = ("piece", "piece_end"),
) -> jax.Array:
  """Several row pieces of ``x``, each times ``w``, in one kernel launch.

  Piece ``i`` is ``x[x_rows[i] : x_rows[i] + rows] @ w``, read in place.
  Without ``out`` the pieces are stacked in order into a fresh array: the
  reduce-scatter's step granularity (the partials of every peer, whose rows
  are not contiguous in ``x``, as one dot with no gathering copy). With
  ``out``, piece ``i`` is written into rows ``[out_rows[i], out_rows[i] +
  rows)`` of ``out`` (aliased, as `chunk_matmul_into`): the all-gather's
  step granularity (landed pieces written at their owners' rows).

  Args:
    x: ``[M, K]`` left operand, bf16/f16/f32.
    x_rows: first row of each piece in ``x``: Python ints (checked: ``0 <=
      r <= M - rows``) or traced int32 scalars (not checked), multiples of 8
      on the Hopper path; or a `ByRank` (each rank's static rows, checked),
      which the Hopper kernel compiles in so that it reads only the rank.
    rows: rows per piece (a multiple of the CTA tile's rows on the Hopper
      path, so no tile straddles two pieces).
    w: ``[K, n]``, same dtype as ``x``.
    out: None, or the ``[M_out, n]`` array the pieces are written into.
    out_rows: with ``out`` or ``fresh_rows``, the first row of each piece
      in the result (same rules as ``x_rows``; with a `ByRank` on either
      side the other holds static ints or a `ByRank` of the same rank);
      None otherwise (pieces stacked from row 0).
    num_sms, preferred_element_type, interpret, config: as for
      ``chunk_matmul_into`` (with ``out``, ``preferred_element_type`` must be
      None or ``out.dtype``).
    x_zero_padded_k: ``x`` is `pad_k`'s output for a ``w`` of ``K`` rows:
      its columns past ``K`` are zeros (not checked), up to a multiple of 64.
    addends: arrays of ``n`` columns added to the product, in f32, before
      it is rounded: row ``t`` of the product (its pieces stacked, before
      they are placed) gets ``a[a0 + t]`` of each addend ``a``. The
      reduce-scatter adds the partials pulled from its peers this way, in
      the kernel's epilogue, instead of in a separate pass.
    addend_rows: the static first row ``a0`` read from each addend (None:
      0 for every addend), a multiple of 8 on the Hopper path; so one
      buffer holding several partials is given once per partial, unsliced.
    fresh_rows: without ``out``: the rows of the fresh result, the pieces
      placed at ``out_rows``; rows no piece covers are left **unwritten**
      (the caller fills them, e.g. with later calls that pass this result
      as ``out``). None: the pieces stacked, ``len(x_rows) * rows`` rows.
      On the Hopper path the result is typed invariant over shard_map's
      axes, as every result written in place is (jax >= 0.11 takes no
      varying Ref): restore its type with `vma.vary_like` when done.
    landed: ``(flags, index)``: ``x`` is still being written by copy queues
      when the kernel starts, and each sets its int32 flag in ``flags``
      (device memory) once its rows have landed; the CTAs walk the pieces
      in order and wait in the kernel until ``flags[index[i]] >= 1`` before
      they read piece ``i`` (the signalled all-gather). Hopper path only:
      an interpreted launch reads ``x`` as it is, so its caller waits for
      the pieces first (a ValueError here otherwise).

  Returns:
    ``[len(x_rows) * rows, n]`` (or ``[fresh_rows, n]``) of
    ``preferred_element_type`` (default ``x.dtype``), or ``out`` with the
    pieces' rows replaced.
  """
  if getattr(x, "ndim", None) != 2 or getattr(w, "ndim", None) != 2:
    raise ValueError(
        f"x and w must be 2-D, got x.shape={getattr(x, 'shape', None)},"
        f" w.shape={getattr(w, 'shape', None)}.")
  if not isinstance(x_rows, ByRank):
    x_rows = list(x_rows)
  if not len(x_rows):  # pylint: disable=g-explicit-length-test
    raise ValueError("x_rows must name at least one piece, got [].")
  if (isinstance(rows, bool) or not isinstance(rows, int)
      or not 0 < rows <= x.shape[0]):
    raise ValueError(f"rows={rows!r} must be an int in [1, {x.shape[0]}]"
                     f" (x.shape={x.shape}).")
  if fresh_rows is not None:
    if out is not None or out_rows is None:
      raise ValueError("fresh_rows needs out=None and out_rows (where the"
                       " pieces go in the fresh result).")
    if (isinstance(fresh_rows, bool) or not isinstance(fresh_rows, int)
        or fresh_rows < rows):
      raise ValueError(f"fresh_rows={fresh_rows!r} must be an int of at"
                       f" least rows={rows}.")
  elif (out is None) != (out_rows is None):
    raise ValueError("out and out_rows go together: pass both or neither"
                     f" (out is {'None' if out is None else 'given'}).")
  if out_rows is not None:
    if not isinstance(out_rows, ByRank):
      out_rows = list(out_rows)
    if len(out_rows) != len(x_rows):
      raise ValueError(f"out_rows has {len(out_rows)} entries, x_rows"
                       f" {len(x_rows)}: one per piece.")
  if out is not None:
    dtype = jnp.dtype(out.dtype)
  else:
    dtype = jnp.dtype(preferred_element_type or x.dtype)
  _check_num_sms(num_sms)
  addends = list(addends)
  addend_rows = ([0] * len(addends) if addend_rows is None
                 else [_static_int("addend_rows", a) for a in addend_rows])
  _check_addends(addends, addend_rows, len(x_rows) * rows, w.shape[1])
  if x_zero_padded_k:
    k = w.shape[0]
    if x.shape[1] != padded_k(k):
      raise ValueError(
          f"x_zero_padded_k: x.shape={x.shape} must have padded_k(K) ="
          f" {padded_k(k)} columns for w.shape={w.shape} (use pad_k).")
  n_pieces = len(x_rows)
  piece_type = jax.ShapeDtypeStruct(
      (rows, w.shape[0] if x_zero_padded_k else x.shape[1]), x.dtype)
  target = (out if out is not None else jax.ShapeDtypeStruct(
      (fresh_rows or n_pieces * rows, w.shape[1]), dtype))
  # Shapes and dtypes, as for one piece written at row 0 of the target.
  _check_args(target, piece_type, w, 0, preferred_element_type)
  _check_piece_rows("x_rows", x_rows, rows, x.shape)
  if out_rows is not None:
    _check_piece_rows("out_rows", out_rows, rows, target.shape)
  if landed is not None:
    flags, index = landed
    if len(index) != n_pieces:
      raise ValueError(f"landed's index has {len(index)} entries, x_rows"
                       f" {n_pieces}: one flag per piece.")
  if _resolve_interpret(interpret):
    if landed is not None:
      raise ValueError(
          "landed needs the Hopper kernel (it waits in the kernel); an"
          " interpreted launch reads x as it is: wait for the pieces first"
          " and pass landed=None.")
    if x_zero_padded_k:
      x = x[:, :w.shape[0]]
    x_rows = x_rows.traced() if isinstance(x_rows, ByRank) else x_rows
    if isinstance(out_rows, ByRank):
      out_rows = out_rows.traced()
    pieces = [lax.dynamic_slice_in_dim(x, r, rows, axis=0) for r in x_rows]
    if fresh_rows is not None:
      out = jnp.zeros((fresh_rows, w.shape[1]), dtype)
    if addends:
      # As the kernel: the f32 product plus the addends, rounded once.
      total = chunk_matmul(jnp.concatenate(pieces, 0), w,
                           preferred_element_type=jnp.float32,
                           interpret=True)
      for a, a0 in zip(addends, addend_rows):
        total = total + a[a0:a0 + total.shape[0]].astype(jnp.float32)
      total = total.astype(dtype)
      if out is None:
        return total
      for i, r in enumerate(out_rows):
        out = lax.dynamic_update_slice_in_dim(
            out, total[i * rows:(i + 1) * rows], r, axis=0)
      return out
    if out is None:
      return chunk_matmul(jnp.concatenate(pieces, 0), w,
                          preferred_element_type=dtype, interpret=True)
    for piece, r in zip(pieces, out_rows):
      out = chunk_matmul_into(out, piece, w, r, interpret=True)
    return out
  for r in (*static_rows(x_rows), *static_rows(out_rows or ()),
            *addend_rows):
    if isinstance(r, (int, np.integer)) and r % 8:
      raise ValueError(
          f"row offset {r} must be a multiple of 8 on the Hopper path (TMA"
          " transfers of 8-row tiled shared memory).")
  _hopper_offset(0)
  dest_rows = (out_rows if out_rows is not None
               else [i * rows for i in range(n_pieces)])
  if isinstance(x_rows, ByRank) or isinstance(dest_rows, ByRank):
    off = by_rank_offsets(dest_rows, x_rows)
  else:
    off = piece_offsets(dest_rows, x_rows)
  return hopper.mgpu_into(out, x, w, off,
                         num_sms=num_sms, config=config, rows=n_pieces * rows,
                         out_dtype=dtype, addends=addends,
                         addend_rows=addend_rows, fresh_rows=fresh_rows,
                         flags=_flags, flag_variant=_flag_variant,
                         landed=None if landed is None else landed[0],
                         landed_index=None if landed is None else landed[1])


def chunk_matmul_flagged(
    x: jax.Array,
    x_rows: ByRank,
    rows: int,
    w: jax.Array,
    flags: jax.Array,
    *,
    num_sms: int | None = None,
    preferred_element_type: Any = None,
    interpret: bool | None = None,
    config: ChunkMatmulConfig | None = None,
    x_zero_padded_k: bool = False,
) -> tuple[jax.Array, jax.Array, int]:
  """`chunk_matmul_pieces` (stacked, fresh result) that signals each piece.

  One launch multiplies every piece, in order, and bumps ``flags[i]``
  once per compute warpgroup of each CTA, after that CTA's last tile of
  piece ``i`` is stored: the reduce-scatter's flagged granularity,
  whose copy engines start on a piece as soon as its flag reaches the
  target, with one kernel and one start per op instead of one of each per
  piece.

  Args:
    x, x_rows, rows, w, num_sms, preferred_element_type, interpret, config,
      x_zero_padded_k: as for `chunk_matmul_pieces`.
    flags: ``int32[len(pieces)]`` of zeros (`peer_copy.arm`'s), typed
      invariant over shard_map's axes (the kernel writes it in place).

  Returns:
    (the stacked pieces, the flags as written, the target a flag reaches
    once its piece is complete). Interpret mode computes everything before
    it returns, so there every flag is 1 and the target 1.
  """
  n_pieces = len(x_rows)
  if (getattr(flags, "shape", None) != (n_pieces,)
      or getattr(flags, "dtype", None) != jnp.int32):
    raise ValueError(
        f"flags must be int32[{n_pieces}] (one per piece), got"
        f" {getattr(flags, 'dtype', None)}{list(getattr(flags, 'shape', []))}.")
  interpret = _resolve_interpret(interpret)
  out = chunk_matmul_pieces(x, x_rows, rows, w, num_sms=num_sms,
                            preferred_element_type=preferred_element_type,
                            interpret=interpret, config=config,
                            x_zero_padded_k=x_zero_padded_k,
                            _flags=None if interpret else flags)
  # The Hopper path returns (pieces, flags, target) itself.
  return (out, flags + 1, 1) if interpret else out
