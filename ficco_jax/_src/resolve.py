"""What ``schedule=None`` becomes: the one order in which a schedule is chosen.

First match wins:

1. the ``schedule`` the caller passes;
2. the autotune cache's entry for (device kind, axis size, op, local shapes,
   axis, dtype, process count): the user's file
   (`ficco_jax.set_autotune_cache`, default
   ``~/.cache/ficco_jax/autotune.json``) over the package's shipped data
   (and, while `ficco_jax.autotune_model` compiles a function with what it
   measured, those entries over both);
3. the heuristic, a cost model (`heuristics.decide`).

Steps 2 and 3 run at trace time, so a jitted function keeps the schedule it
was traced with: autotune before the first call to use its result. The ops,
`ficco_jax.choose_schedule` and `ficco_jax.explain` all resolve here, so
they agree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import numpy as np

from ficco_jax._src import devices
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import schedule_checks
from ficco_jax._src import validation
from ficco_jax._src.pallas import config as pallas_config
from ficco_jax._src.tuning import autotune_cache
from ficco_jax._src.tuning import device_params
from ficco_jax._src.tuning import heuristics
from ficco_jax._src.tuning import moe_heuristic

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
MOE_OPS = moe_heuristic.OPS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """The machine a schedule is chosen for.

  Attributes:
    device_kind: the device kind (keys the cache and the model's constants).
    platform: ``"gpu"``, ``"cpu"``, ...: off GPUs nothing overlaps.
    assume_dma: plan as if the copy-engine library were built in (for a
      device kind that is not the one at hand).
  """

  device_kind: str
  platform: str
  assume_dma: bool


def target(device_kind: str | None = None) -> Target:
  """The `Target` for ``device_kind``: None or this process's own kind
  plans for the devices at hand (their platform and this install's
  libraries); any other kind is planned for as a GPU of that kind with the
  copy-engine library available."""
  here = devices.device_kind()
  if device_kind is None or device_kind == here:
    return Target(device_kind=here, platform=devices.platform(),
                  assume_dma=False)
  return Target(device_kind=device_kind, platform="gpu", assume_dma=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resolution:
  """A resolved schedule and where it came from.

  Attributes:
    schedule: what the op runs.
    source: ``"explicit"``, ``"autotune cache"`` or ``"heuristic"``.
    reason: why, in words.
    target: the machine it was chosen for.
  """

  schedule: schedule_lib.Schedule
  source: str
  reason: str
  target: Target


def check_op(op: str, moe: bool = False) -> None:
  ops = OPS + MOE_OPS if moe else OPS
  if op not in ops:
    raise ValueError(f"op={op!r} must be one of {ops}.")


def moe_hopper(tgt: Target) -> bool:
  """Whether ``tgt`` runs the MoE grouped kernel's wgmma (sm_90): the
  device at hand's compute capability, or another kind's name."""
  if tgt.assume_dma:  # Another kind: planned for as a GPU of that kind.
    return moe_heuristic.kind_is_hopper(tgt.device_kind)
  return pallas_config.hopper_kernel_runs(devices.local_device(),
                                          np.float16)


def moe_default(op: str, *, x_shape, w_shape, dtype, axis_size: int,
                tgt: Target, w_dtype=None, out_dtype=None, precision=None,
                one_program: bool = True) -> tuple[Resolution, str | None]:
  """Steps 2 and 3 for a MoE op: the autotune cache's entry for these
  shapes if the call can run it, else `moe_heuristic.decide` for ``tgt``.

  Args:
    op, x_shape, w_shape, dtype, axis_size: as for `default_schedule`.
    tgt: the target.
    w_dtype, out_dtype, precision, one_program: the call's, as
      `moe_heuristic.decide` takes them (the defaults: a call with no
      ``precision`` and the result in the operands' dtype, under jit).

  Returns:
    ``(resolution, refused)``: ``refused`` says why the cache's entry
    cannot run this call, or is None (no entry, or it runs).
  """
  call = dict(w_dtype=w_dtype, out_dtype=out_dtype, precision=precision)
  cached = cached_schedule(op, device_kind=tgt.device_kind,
                           axis_size=axis_size, x_shape=x_shape,
                           w_shape=w_shape, axis=0, dtype=dtype)
  refused = None
  if cached is not None:
    why = moe_heuristic.cached_unfit(
        cached, platform=tgt.platform,
        kernel_why=moe_heuristic.kernel_unfit(
            w_shape=w_shape, dtype=dtype, hopper=moe_hopper(tgt),
            device_desc=tgt.device_kind, **call),
        one_program=one_program)
    if why is None:
      return Resolution(schedule=cached, source="autotune cache",
                        reason="measured fastest for these shapes (with"
                        " the tuning call's routing)", target=tgt), None
    refused = (f"the autotune cache's {cached.short()} for these shapes"
               f" cannot run this call ({why})")
  return moe_decide(op, w_shape=w_shape, dtype=dtype, tgt=tgt,
                    one_program=one_program, **call), refused


def moe_decide(op: str, *, w_shape, dtype, tgt: Target, w_dtype=None,
               out_dtype=None, precision=None,
               one_program: bool = True) -> Resolution:
  """Step 3 for a MoE op: `moe_heuristic.decide` for ``tgt`` (arguments as
  for `moe_default`)."""
  schedule, reason = moe_heuristic.decide(
      op, w_shape=w_shape, dtype=dtype, w_dtype=w_dtype, out_dtype=out_dtype,
      precision=precision, platform=tgt.platform, hopper=moe_hopper(tgt),
      device_desc=tgt.device_kind, processes=jax.process_count(),
      one_program=one_program)
  return Resolution(schedule=schedule, source="heuristic", reason=reason,
                    target=tgt)


def default_schedule(op: str, *, x_shape, w_shape, dtype, axis_size: int,
                     axis: int = 0, device_kind: str | None = None,
                     out_dtype=None, operand_kind: str | None = None
                     ) -> Resolution:
  """Steps 2 and 3 of the order: what ``schedule=None`` runs, and why.

  Args:
    op: ``"all_gather_matmul"``, ``"matmul_reduce_scatter"``, or a MoE op
      (``"all_to_all_matmul"``, ``"matmul_all_to_all"``: decided by
      `moe_heuristic` for calls with no ``precision`` and the result in the
      operands' dtype: the autotune cache, then `moe_heuristic`).
    x_shape, w_shape: local shapes, as the op sees them inside shard_map.
    dtype: the first operand's dtype.
    axis_size: devices along the axis.
    axis: the gathered / scattered axis of the first operand.
    device_kind: see `target`. Inside ``shard_map`` tracing no concrete
      device is at hand, so the ops pass None: the kind of the default
      backend's first device (the mesh is assumed to be of that backend).
    out_dtype, operand_kind: the tensor-parallel call's result dtype (None:
      ``dtype``) and its first operand's type name (None: traced under
      ``jax.jit``), as `schedule_checks.check` takes them: neither the
      cache's entry nor the heuristic's pick is served where the call
      cannot run it (an eager ``shard_map`` or ``jax.vmap`` call has no
      copy engines, say). The defaults are a jitted call's, which is what
      `choose_schedule` and `explain` plan for.

  Returns:
    The `Resolution`.
  """
  check_op(op, moe=True)
  x_shape = tuple(int(d) for d in x_shape)
  w_shape = tuple(int(d) for d in w_shape)
  axis = _check_problem(op, x_shape, w_shape, dtype, axis_size, axis)
  tgt = target(device_kind)
  if op in MOE_OPS:
    res, refused = moe_default(op, x_shape=x_shape, w_shape=w_shape,
                               dtype=dtype, axis_size=axis_size, tgt=tgt)
    if refused is not None:  # As the op does, which also logs it.
      res = dataclasses.replace(res, reason=f"{refused}; {res.reason}")
    return res
  call = dict(a_name="x" if op == "all_gather_matmul" else "h", dtype=dtype,
              out_dtype=out_dtype, axis_size=axis_size,
              operand_kind=operand_kind)
  cached = cached_schedule(op, device_kind=tgt.device_kind,
                           axis_size=axis_size, x_shape=x_shape,
                           w_shape=w_shape, axis=axis, dtype=dtype)
  refused = None
  if cached is not None:
    why = schedule_checks.unfit(op, cached, **call)
    if why is None:
      return Resolution(schedule=cached, source="autotune cache",
                        reason="measured fastest for this shape", target=tgt)
    # An entry another call stored (a jitted one, say), or a file edited
    # by hand: this call takes the heuristic's pick, and the user is told.
    refused = (f"the autotune cache's {cached.short()} for these shapes"
               f" cannot run this call ({why})")
    heuristics.warn_once(f"ficco_jax: {op}: {refused}; schedule=None takes"
                         " the heuristic's pick instead.")
  res = _decide(op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
                axis_size=axis_size, axis=axis, tgt=tgt, call=call)
  if refused is not None:
    res = dataclasses.replace(res, reason=f"{refused}; {res.reason}")
  return res


def _decide(op: str, *, x_shape, w_shape, dtype, axis_size: int, axis: int,
            tgt: Target, call: Mapping[str, Any]) -> Resolution:
  """Step 3 for a tensor-parallel op: the heuristic's pick for a jitted
  call, or, where this call cannot run it, its best pick that the call can
  (logged: the call gives up overlap it would have had under jit)."""
  if jax.process_count() > 1:
    heuristics.warn_once(
        f"ficco_jax: schedule=None in a job of {jax.process_count()}"
        " processes found no autotune entry measured in that layout, so the"
        " cost model picks, and it was fitted in one process driving every"
        " GPU. Run ficco_jax.autotune(...) in this job, or pass a schedule.")
  decide = functools.partial(
      heuristics.decide, op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
      axis_size=axis_size, axis=axis, platform=tgt.platform,
      params=device_params.params_for(tgt.device_kind),
      assume_dma=tgt.assume_dma, processes=jax.process_count())
  schedule, reason = decide()
  why = schedule_checks.unfit(op, schedule, **call)
  if why is not None:
    first = schedule
    if call["operand_kind"] in validation.NOT_ONE_PROGRAM:
      schedule, reason = decide(comms=("xla",))
    if schedule_checks.unfit(op, schedule, **call) is not None:
      # The model times XLA's dots; the kernel's dtypes are the rest.
      schedule = dataclasses.replace(schedule, compute="xla")
    if schedule_checks.unfit(op, schedule, **call) is not None:
      schedule = schedule_lib.NO_OVERLAP
    heuristics.warn_once(
        f"ficco_jax: {op}: schedule=None's pick for a jitted call,"
        f" {first.short()}, cannot run this call ({why}); it runs"
        f" {schedule.short()} instead.")
    reason = (f"{first.short()} (the pick for a jitted call) cannot run"
              f" this call ({why}); {reason}")
  return Resolution(schedule=schedule, source="heuristic", reason=reason,
                    target=tgt)


def _check_problem(op: str, x_shape, w_shape, dtype, axis_size,
                   axis: int) -> int:
  """What the op itself would refuse, refused here too (`choose_schedule`
  and `explain` must not plan a call that cannot run); returns ``axis``
  normalized, as the op keys the autotune cache by it."""
  where = f"{op}: x_shape={x_shape}, w_shape={w_shape}"
  if isinstance(axis_size, bool) or not isinstance(
      axis_size, (int, np.integer)) or axis_size < 1:
    raise ValueError(f"{op}: axis_size={axis_size!r} must be an int >= 1.")
  try:
    supported = np.dtype(dtype) in validation.SUPPORTED_DTYPES
  except TypeError:
    supported = False
  if not supported:
    raise TypeError(f"{op}: dtype={dtype!r} must be float16, bfloat16,"
                    " float32 or float64 (the operands' promoted dtype).")
  if any(d < 1 for d in x_shape + w_shape):
    raise ValueError(f"{where}: every dimension must be at least 1.")
  if op in MOE_OPS:
    if len(x_shape) != 2 or len(w_shape) != 3 or x_shape[1] != w_shape[1]:
      raise ValueError(
          f"{op}: w_shape={w_shape} must be [E_l, d, f] (dispatch) or"
          f" [E_l, f, d] (combine), and x_shape={x_shape} [rows, d] (or"
          " [rows, f]): one matrix per local expert, the contraction sizes"
          " equal.")
    return axis
  if len(x_shape) < 2 or len(w_shape) != 2 or x_shape[-1] != w_shape[0]:
    raise ValueError(
        f"{where}: expected x [..., rows, ..., k] and w [k, n] with equal"
        " contraction sizes k.")
  axis = validation.normalize_axis("axis", axis, len(x_shape), x_shape)
  if op == "matmul_reduce_scatter" and x_shape[axis] % axis_size:
    raise ValueError(
        f"{where}: x_shape[{axis}] ({x_shape[axis]}) must be divisible by"
        f" axis_size ({axis_size}): the rows are scattered.")
  return axis


def choose_schedule(op: str, *, x_shape, w_shape, dtype, axis_size: int,
                    axis: int = 0, device_kind: str | None = None
                    ) -> schedule_lib.Schedule:
  """The schedule ``schedule=None`` runs for these local shapes.

  The autotune cache's entry if there is one, else the cost-model heuristic
  (`ficco_jax.explain` says which, and why). Same arguments, same answer
  as the op traced on the devices at hand.

  Args:
    op: ``"all_gather_matmul"``, ``"matmul_reduce_scatter"``,
      ``"all_to_all_matmul"`` or ``"matmul_all_to_all"`` (the MoE ops: for
      calls with no ``precision`` and the result in the operands' dtype).
    x_shape: the local (per-device) shape of the op's first operand (``x``
      or ``h``), as the op sees it inside ``shard_map``.
    w_shape: the local shape of ``w`` (the MoE ops: ``[E_l, d, f]`` for
      the dispatch, ``[E_l, f, d]`` for the combine).
    dtype: element type of the operands as the op multiplies them: for
      the tensor-parallel ops ``jnp.result_type(x, w)`` (they promote
      first: bf16 activations with f32 weights are a float32 call), for
      the MoE ops ``x``'s.
    axis_size: devices along the axis.
    axis: ``gather_axis`` or ``scatter_axis``.
    device_kind: None (or this process's own device kind): plan for the
      devices at hand. Another kind (e.g. ``"NVIDIA H200"`` from a laptop)
      is planned for as a GPU of that kind with ficco's copy-engine
      library built in.

  Returns:
    A `ficco_jax.Schedule`; ``dataflow="none"`` where overlap would not
    pay.
  """
  return default_schedule(op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
                          axis_size=axis_size, axis=axis,
                          device_kind=device_kind).schedule


def cached_schedule(op: str, *, device_kind: str, axis_size: int, x_shape,
                    w_shape, axis: int, dtype) -> schedule_lib.Schedule | None:
  """The autotune cache's schedule for an op, or None (step 2).

  Keyed by this job's process count too (`autotune_cache.Key`), and tried
  for each shape of `_cache_shapes`.
  """
  for shape, ax in _cache_shapes(x_shape, axis):
    key = autotune_cache.Key.of(op, device_kind=device_kind,
                                axis_size=axis_size, x_shape=shape,
                                w_shape=w_shape, axis=ax, dtype=dtype,
                                processes=jax.process_count())
    cached = autotune_cache.lookup(key)
    if cached is not None and _fits(op, cached, x_shape, axis, axis_size):
      return cached
  return None


def _cache_shapes(x_shape, axis):
  """The operand shapes whose cache entries fit this op, best match first.

  The shape itself; then, when every dimension before ``axis`` is 1 (a
  sequence-parallel ``[1, S / P, d]`` activation, say), the 2-D ``[rows,
  K]`` the op reduces to: moving ``axis`` first is then free and the op
  folds the remaining dims into rows, so it runs the same dots and moves
  the same bytes as the 2-D op.
  """
  x_shape = tuple(int(d) for d in x_shape)
  yield x_shape, axis
  if len(x_shape) > 2 and all(d == 1 for d in x_shape[:axis]):
    yield (int(np.prod(x_shape[:-1])), x_shape[-1]), 0


def _fits(op, schedule, x_shape, axis, axis_size) -> bool:
  # A 2-D entry's chunk count divides the folded rows; the op cuts along
  # ``axis`` only.
  split = x_shape[axis]
  if op == "matmul_reduce_scatter":
    split //= axis_size
  return split % schedule.num_chunks == 0


def resolve(op: str, schedule, *, x_shape, w_shape, axis: int,
            call: Mapping[str, Any]) -> Resolution:
  """The schedule a call runs (step 1, else `default_schedule`), and where
  it came from (``source="explicit"`` for step 1).

  ``call`` is the call as `schedule_checks.check` takes it (``dtype``,
  ``out_dtype``, ``axis_size``, ``operand_kind``, ``a_name``).
  """
  if schedule is None:
    return default_schedule(op, x_shape=x_shape, w_shape=w_shape,
                            dtype=call["dtype"], axis_size=call["axis_size"],
                            axis=axis, out_dtype=call["out_dtype"],
                            operand_kind=call["operand_kind"])
  if not isinstance(schedule, schedule_lib.Schedule):
    raise TypeError(
        f"schedule must be a ficco_jax.Schedule or None, got {schedule!r}.")
  return Resolution(schedule=schedule, source="explicit",
                    reason="passed by the caller", target=target())
