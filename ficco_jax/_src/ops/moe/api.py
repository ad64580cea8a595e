"""``ficco_jax.all_to_all_matmul`` and ``ficco_jax.matmul_all_to_all``: the
expert-parallel exchange and its grouped matmul, decomposed per peer."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ficco_jax._src import devices
from ficco_jax._src import matmul
from ficco_jax._src import resolve
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import validation
from ficco_jax._src.ops.all_gather_matmul.api import DEFAULT_TIMEOUT_S
from ficco_jax._src.ops.moe import combine_dma
from ficco_jax._src.ops.moe import dispatch_dma
from ficco_jax._src.ops.moe import exchange
from ficco_jax._src.ops.moe import routing
from ficco_jax._src.tuning import heuristics
from ficco_jax._src.tuning import moe_heuristic


def _kernel_unfit(a, w, precision, out_dtype) -> str | None:
  """Why the GPU grouped kernel cannot take this call, or None
  (`moe_heuristic.kernel_unfit` on the device at hand)."""
  tgt = resolve.target()
  return moe_heuristic.kernel_unfit(
      w_shape=w.shape, dtype=a.dtype, w_dtype=w.dtype, out_dtype=out_dtype,
      precision=precision, hopper=resolve.moe_hopper(tgt),
      device_desc=tgt.device_kind)


def _one_program(a) -> bool:
  """Whether the op is traced into one compiled program (not eager
  ``shard_map``, not ``vmap``): what the copy engines need."""
  return validation.operand_kind(a) not in validation.NOT_ONE_PROGRAM


def _resolve(op: str, a, w, axis_size: int, precision,
             out_dtype) -> tuple[resolve.Resolution, str | None]:
  """`resolve.moe_default` for this call on the device at hand."""
  return resolve.moe_default(
      op, x_shape=a.shape, w_shape=w.shape, dtype=a.dtype,
      axis_size=axis_size, tgt=resolve.target(), w_dtype=w.dtype,
      out_dtype=out_dtype, precision=precision, one_program=_one_program(a))


def default_schedule(op: str, a, w, precision,
                     out_dtype) -> schedule_lib.Schedule:
  """``schedule=None``'s heuristic alone: `moe_heuristic.decide` on the
  device at hand (the experts on the grouped kernel where it takes the
  call, the rows on the copy engines where the experts are narrow;
  `ficco_jax.explain` says which and why)."""
  return resolve.moe_decide(
      op, w_shape=w.shape, dtype=a.dtype, tgt=resolve.target(),
      w_dtype=w.dtype, out_dtype=out_dtype, precision=precision,
      one_program=_one_program(a)).schedule


def _schedule(op: str, schedule: schedule_lib.Schedule | None, a, w,
              axis_size: int, precision,
              out_dtype) -> schedule_lib.Schedule:
  """The MoE ops' schedules: the exchange in one all-to-all (``none``) or a
  piece per peer (``direct``) over XLA's collectives, and ``direct`` on the
  copy engines; the experts on XLA's ``ragged_dot`` or ficco's grouped
  matmul (``compute="pallas"``). None: the autotune cache's entry for these
  shapes, else `default_schedule` (`resolve`'s order)."""
  if schedule is None:
    res, refused = _resolve(op, a, w, axis_size, precision, out_dtype)
    if refused is not None:
      heuristics.warn_once(f"ficco_jax: {op}: {refused}; schedule=None takes"
                           " the heuristic's pick instead.")
    return res.schedule
  if not isinstance(schedule, schedule_lib.Schedule):
    raise TypeError(f"{op}: schedule must be a ficco_jax.Schedule or None,"
                    f" got {schedule!r}.")
  why = moe_heuristic.unsupported(schedule)
  if why is not None:
    raise ValueError(f"{op}: {why}.")
  return schedule


def _check_compute(op: str, sched: schedule_lib.Schedule, a, w,
                   precision, out_dtype) -> None:
  """``compute="pallas"``: the grouped kernel takes the call (forward and
  gradient) or the call is an error naming why."""
  if sched.compute != "pallas":
    return
  if precision is not None:
    raise ValueError(f"{op}: precision={precision!r} applies to XLA's"
                     " ragged_dot; Schedule(compute='pallas') multiplies in"
                     " the operands' dtype with f32 accumulation. Pass"
                     " precision=None or use compute='xla'.")
  if devices.platform() != "gpu":
    return  # The portable kernel (interpreter) takes any shape and dtype.
  why = _kernel_unfit(a, w, precision, out_dtype)
  if why is not None:
    raise ValueError(
        f"{op}: Schedule(compute='pallas') runs the Hopper grouped-matmul"
        f" kernel, which cannot take this call: {why}. Use"
        " Schedule(compute='xla').")


def _piece_rows(op: str, tokens: int, capacity: int, piece_capacity) -> int:
  """Static rows of one peer's piece: ``min(T, capacity)`` unless
  ``piece_capacity`` lowers it."""
  rows = min(tokens, capacity)
  if piece_capacity is None:
    return rows
  return min(rows, _positive_int(op, "piece_capacity", piece_capacity))


def _prepare(op: str, a, w, group_sizes, *, axis_name: str, axis_size: int,
             tokens: int, capacity: int, piece_capacity, schedule, precision,
             preferred_element_type, check_routing: bool,
             capacity_of: str | None = None):
  """What both ops resolve before they move rows: the schedule, the call's
  `exchange.MoeStatic` and the routing (checked on the device if asked;
  ``capacity_of`` names where the combine's capacity comes from)."""
  if not isinstance(check_routing, (bool, np.bool_)):
    raise TypeError(f"{op}: check_routing must be True or False, got"
                    f" {check_routing!r}.")
  out_dtype = _out_dtype(op, a, w, preferred_element_type)
  sched = _schedule(op, schedule, a, w, axis_size, precision, out_dtype)
  _check_compute(op, sched, a, w, precision, out_dtype)
  st = exchange.MoeStatic(
      op_name=op, axis_name=axis_name, axis_size=axis_size, capacity=capacity,
      piece_rows=_piece_rows(op, tokens, capacity, piece_capacity),
      dataflow=sched.dataflow, compute=sched.compute, precision=precision,
      out_dtype=out_dtype)
  r = routing.route(group_sizes, axis_name=axis_name, axis_size=axis_size)
  if check_routing:
    routing.check(group_sizes, r, tokens=tokens, capacity=capacity,
                  piece_rows=st.piece_rows, op_name=op, axis_name=axis_name,
                  capacity_of=capacity_of)
  return sched, st, r


def _copy_static(op: str, axis_name: str, p: int,
                 sched: schedule_lib.Schedule, timeout_s) -> matmul.Static:
  """The copy-engine config of a ``comm="dma"`` call (the gather engine
  and the peer-copy primitives read axis, op, transport and timeout)."""
  return matmul.make_static(op, axis_name=axis_name, axis_size=p,
                            schedule=sched, precision=None,
                            preferred_element_type=None,
                            timeout_s=validation.check_timeout(timeout_s))


def _check(op: str, a_name: str, a, w, group_sizes, axis_name) -> int:
  """Checks the operands; returns the axis size."""
  for name, v in ((a_name, a), ("w", w), ("group_sizes", group_sizes)):
    if validation.operand_kind(v) == "BatchTracer":
      # lax.ragged_dot batches over nothing but its leading axis, and the
      # exchange's pieces would need their own batch axis too.
      raise NotImplementedError(
          f"{op}: {name} is batched by jax.vmap, which the MoE ops do not"
          " support; fold the batch into the token rows (and their"
          " group_sizes) or loop over it with lax.map.")
  validation.check_array(a_name, a)
  if not isinstance(group_sizes, jax.Array) and isinstance(
      group_sizes, (list, tuple)):
    raise TypeError(f"{op}: group_sizes is a Python {type(group_sizes).__name__};"
                    " pass an integer array (jnp.asarray(group_sizes)).")
  if a.ndim != 2:
    raise ValueError(f"{op}: {a_name} must be [tokens, d], got shape"
                     f" {tuple(a.shape)}.")
  validation.check_array("w", w, min_rank=3)
  if w.ndim != 3 or w.shape[1] != a.shape[1]:
    raise ValueError(f"{op}: w must be [local experts, d, f] with d ="
                     f" {a_name}.shape[1] = {a.shape[1]}, got shape"
                     f" {tuple(w.shape)}.")
  validation.check_nonempty(a_name, a)
  validation.check_nonempty("w", w)
  if not hasattr(group_sizes, "dtype") or not jnp.issubdtype(
      group_sizes.dtype, jnp.integer) or group_sizes.ndim != 1:
    raise TypeError(f"{op}: group_sizes must be a 1-D integer array (rows"
                    " per global expert), got"
                    f" {getattr(group_sizes, 'dtype', type(group_sizes))}"
                    f"{tuple(getattr(group_sizes, 'shape', ()))}.")
  p = validation.axis_size(axis_name, op)
  if group_sizes.shape[0] != p * w.shape[0]:
    raise ValueError(
        f"{op}: group_sizes has shape {tuple(group_sizes.shape)}; expected"
        f" ({p * w.shape[0]},): one count per global expert, the axis size"
        f" {p} times the {w.shape[0]} local experts of w.")
  return p


def _positive_int(op: str, name: str, v) -> int:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral):
    raise TypeError(f"{op}: {name}={v!r} must be an int.")
  if v < 1:
    raise ValueError(f"{op}: {name}={v!r} must be a positive int.")
  return int(v)


def _out_dtype(op: str, a, w, preferred_element_type):
  if preferred_element_type is None:
    return jnp.promote_types(a.dtype, w.dtype)
  try:
    dt = np.dtype(preferred_element_type)
  except TypeError as e:
    raise TypeError(f"{op}: preferred_element_type={preferred_element_type!r}"
                    f" is not a dtype ({e}).") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{op}: preferred_element_type={dt} must be a floating"
                    " dtype.")
  return dt


def all_to_all_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    axis_name: str,
    capacity: int | None = None,
    piece_capacity: int | None = None,
    schedule: schedule_lib.Schedule | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    check_routing: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> jax.Array:
  """Dispatch: tokens to the devices that own their experts, through them.

  ``lax.ragged_all_to_all`` into a source-major layout, then each peer's
  rows through the local experts (a grouped matmul per peer). Call
  inside ``jax.shard_map`` over the expert-parallel axis; device r owns
  experts ``[r * E_l, (r + 1) * E_l)``. Each peer's rows travel and are
  multiplied as one piece (``Schedule(dataflow="direct")``), or all at once
  (``"none"``); ``schedule=None`` picks (`ficco_jax.explain` says why).

  Args:
    x: ``[T, d]`` this device's token rows, sorted by global expert; rows
      past ``sum(group_sizes)`` are ignored.
    w: ``[E_l, d, f]`` this device's experts.
    group_sizes: ``[P * E_l]`` int: rows of ``x`` per global expert.
    axis_name: the ``shard_map`` axis the experts are spread over.
    capacity: rows a device can receive (static). None: ``P * T``, which
      no valid routing exceeds.
    piece_capacity: rows one peer can send a device (static). None:
      ``min(T, capacity)``, which no valid routing exceeds. Every peer's
      piece has this many rows whatever the counts, so values near the rows
      really sent keep the exchanged rows near the routed ones.
    schedule: a `ficco_jax.Schedule` with ``dataflow`` "none" or "direct";
      "direct" may move the pieces on the copy engines (``comm="dma"``,
      transport rendezvous or window, under ``jax.jit``; its gradient is
      the XLA version's, recomputed in the backward pass). ``compute``:
      "xla" (``lax.ragged_dot``) or "pallas" (ficco's grouped matmul, which
      multiplies only the tiles holding routed rows; on GPUs the Hopper
      kernel: an sm_90 GPU, bf16/f16 operands and result, d and f
      multiples of 128, no ``precision``). None: the autotune cache's
      entry for these local shapes (`ficco_jax.autotune` with
      ``group_sizes``), else the experts on the grouped kernel where it
      takes the call, else on ``ragged_dot``; the
      rows on the copy engines (``direct/c1/dma``) where the kernel runs,
      the experts' width is at most 4096, the op is traced under
      ``jax.jit`` and the job is one process, else ``"none"``
      (docs/moe.md; `ficco_jax.explain` says which and why).
    precision: passed to ``lax.ragged_dot`` (``compute="xla"`` only).
    preferred_element_type: result dtype (floating).
    check_routing: check the counts on every call (one all_gather of five
      numbers per device and a host callback): a negative count, more
      routed rows than T, more received rows than ``capacity`` or more
      rows from one peer than ``piece_capacity`` is then an error of the
      call naming the device, raised when the result is read (the counts
      live on the devices: a ``jax.errors.JaxRuntimeError`` whose message
      holds the ``ValueError``). False
      skips the check and its host round trip; such counts then give
      wrong rows.
    timeout_s: ``comm="dma"`` only: how long to wait for peers.

  Returns:
    ``[capacity, f]``: the rows this device received, peer by peer (peer
    0's first) and within a peer by local expert, each through its expert;
    zeros after them. `matmul_all_to_all` takes this layout back.
  """
  op = "all_to_all_matmul"
  p = _check(op, "x", x, w, group_sizes, axis_name)
  # On every call, not only where the copy engines read it: a call that
  # runs on CPU must not fail on GPUs, where schedule=None may pick them.
  validation.check_timeout(timeout_s)
  t = x.shape[0]
  capacity = p * t if capacity is None else _positive_int(op, "capacity",
                                                          capacity)
  sched, st, r = _prepare(
      op, x, w, group_sizes, axis_name=axis_name, axis_size=p, tokens=t,
      capacity=capacity, piece_capacity=piece_capacity, schedule=schedule,
      precision=precision, preferred_element_type=preferred_element_type,
      check_routing=check_routing)
  if sched.comm == "dma" and p > 1:
    validation.check_traced_for_copy_engines(op, x)
    return dispatch_dma.dispatch(x, w, r, (st, _copy_static(
        op, axis_name, p, sched, timeout_s)))
  return exchange.dispatch(x, w, r, st)


def matmul_all_to_all(
    h: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    axis_name: str,
    num_tokens: int,
    piece_capacity: int | None = None,
    schedule: schedule_lib.Schedule | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    check_routing: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> jax.Array:
  """Combine: received rows through the local experts, back to their tokens.

  The inverse exchange of `all_to_all_matmul`: ``h`` in its output layout
  (``[capacity, d]``), the same ``group_sizes``; each row's product lands
  on the device and at the position its token came from.

  Args:
    h: ``[C, d]`` rows in `all_to_all_matmul`'s output layout.
    w: ``[E_l, d, f]`` this device's experts.
    group_sizes: ``[P * E_l]`` int: the dispatch's counts (of the device
      the tokens are on).
    axis_name: the ``shard_map`` axis the experts are spread over.
    num_tokens: ``T``, the dispatch's token rows per device.
    piece_capacity: as for `all_to_all_matmul` (the same value).
    schedule: as for `all_to_all_matmul`.
    precision: passed to ``lax.ragged_dot`` (``compute="xla"`` only).
    preferred_element_type: result dtype (floating).
    check_routing: as for `all_to_all_matmul` (T is ``num_tokens``, the
      capacity ``h``'s rows).
    timeout_s: ``comm="dma"`` only: how long to wait for peers.

  Returns:
    ``[T, f]``: row i is token row i's product (zeros past
    ``sum(group_sizes)``).
  """
  op = "matmul_all_to_all"
  p = _check(op, "h", h, w, group_sizes, axis_name)
  validation.check_timeout(timeout_s)  # As the dispatch: on every call.
  t = _positive_int(op, "num_tokens", num_tokens)
  sched, st, r = _prepare(
      op, h, w, group_sizes, axis_name=axis_name, axis_size=p, tokens=t,
      capacity=h.shape[0], piece_capacity=piece_capacity, schedule=schedule,
      precision=precision, preferred_element_type=preferred_element_type,
      check_routing=check_routing,
      # The combine has no capacity of its own: h holds the rows the
      # dispatch received, so its rows are the bound.
      capacity_of=(f"h (h.shape[0], the capacity of the all_to_all_matmul"
                   f" that made it; h is {tuple(h.shape)})"))
  if sched.comm == "dma" and p > 1:
    validation.check_traced_for_copy_engines(op, h)
    return combine_dma.combine(h, w, r, (t, st, _copy_static(
        op, axis_name, p, sched, timeout_s)))
  return exchange.combine(h, w, r, t, st)
