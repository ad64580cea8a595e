"""The attributes of every ficco FFI call, built in one place.

Every handler decodes one struct (``xla_ffi/attrs.h``), and XLA requires a
call's attributes to match it exactly; `lower` fills the fields a handler
does not read with their defaults, so each field is spelled once on each
side. The program name is filled in for every call: messages about a
stalled op name the program it belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from ficco_jax._src.dma import primitives

# Name -> default, in attrs.h's order. Spans are int64 arrays.
_NO_SPAN = np.zeros((0,), np.int64)
_DEFAULTS: dict[str, object] = dict(
    op_name="", program="", site=-1, timeout_ms=0, window=-1,
    devices=_NO_SPAN, axis_size=0,
    dst=_NO_SPAN, dst_row=_NO_SPAN, src_offset=_NO_SPAN, shift=_NO_SPAN,
    src=_NO_SPAN, src_row=_NO_SPAN, rows=_NO_SPAN, stream=_NO_SPAN,
    src_flag=_NO_SPAN, num_streams=0, num_flags=0, flag_target=0,
    num_wait=0, keep_bounds=_NO_SPAN,
    own_row=0, chunk_rows=0, num_chunks=0, half_bytes=0, landed=0,
)
NAMES = tuple(_DEFAULTS)


def full(given: Mapping[str, object]) -> dict[str, object]:
  """Every attribute: ``given`` (which must name only known fields) over the
  defaults, as the numpy types the FFI encodes (int64 scalars and arrays,
  strings)."""
  unknown = sorted(set(given) - set(_DEFAULTS))
  if unknown:
    raise TypeError(f"unknown ficco FFI attributes {unknown}; known: {NAMES}")
  out = {}
  for name, default in _DEFAULTS.items():
    value = given.get(name, default)
    if isinstance(default, str):
      out[name] = str(value)
    elif isinstance(default, np.ndarray):
      out[name] = np.asarray(value, np.int64).reshape(-1)
    else:
      out[name] = np.int64(value)
  return out


def lower(target: str, ctx, *operands, has_side_effect: bool = True,
          operand_output_aliases: dict[int, int] | None = None,
          **given) -> Sequence:
  """Lowers one call of the FFI handler ``target`` with ``given`` attributes
  (the rest at their defaults, ``program`` the module being lowered)."""
  given.setdefault("program", primitives.program_name(ctx))
  return jax.ffi.ffi_lowering(
      target, has_side_effect=has_side_effect,
      operand_output_aliases=operand_output_aliases)(
          ctx, *operands, **full(given))
