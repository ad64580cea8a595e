"""Measure candidate schedules on the devices at hand and cache the fastest."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import sharded
from ficco_jax._src.pallas import config as pallas_config
from ficco_jax._src.tuning import autotune_cache
from ficco_jax._src.tuning import cost_model
from ficco_jax._src.tuning import heuristics
from ficco_jax._src.tuning import moe_heuristic


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuneResult:
  """What `autotune` measured.

  Attributes:
    key: the cache key (device kind, axis size, op, local shapes, dtype).
    best: the fastest schedule measured (``"none"`` where no candidate beat
      it by ``margin``).
    timings_ms: ``(schedule.short(), median ms per call)``, fastest first.
    errors: ``(schedule.short(), message)`` of candidates that failed.
    cache_file: where ``best`` was stored (None: not stored).
    store_error: why storing failed (None: stored, or not asked to); the
      measurements above are kept either way.
  """

  key: autotune_cache.Key
  best: schedule_lib.Schedule
  timings_ms: tuple[tuple[str, float], ...]
  errors: tuple[tuple[str, str], ...]
  cache_file: str | None
  store_error: str | None = None


def warm(fn, args: Sequence[Any], warmup: int) -> None:
  """``warmup`` untimed calls (the first compiles), one block at the end."""
  out = None
  for _ in range(max(1, warmup)):
    out = fn(*args)
  jax.block_until_ready(out)


def _round_ms(fn, args: Sequence[Any], iters: int) -> float:
  """Per-call ms of ``iters`` back-to-back calls, one block at the end."""
  out = None
  t0 = time.perf_counter()
  for _ in range(max(1, iters)):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) * 1e3 / max(1, iters)


def time_interleaved(fns: Sequence[Any], args: Sequence[Any], *, rounds: int,
                     iters: int) -> tuple[list[float | None], dict[int, str]]:
  """Times already-warm functions round-robin.

  Why round-robin: on a short, host-bound op the host's speed drifts from
  round to round by more than the gap between two schedules (one schedule
  reads 0.205-0.266 ms over the rounds of one run on a 4xH200 host at
  llama3-8b M4096), so timing candidates one after another would rank the
  drift.
  Each round times every candidate once, in an order rotated by one per
  round (deterministic, unlike the benchmarks' shuffle), after one untimed
  call of that candidate: the previous batch left the devices in another
  program's state.

  Args:
    fns: the functions, each already compiled and warm.
    args: the positional arguments every function takes.
    rounds: timed rounds; each candidate's median round counts.
    iters: back-to-back calls per round (one block at the end).

  Returns:
    (medians, errors): per function its median per-call ms, or None where
    it raised; ``errors`` maps those functions' indices to the message. A
    function that raises is dropped from later rounds; the others go on.
  """
  n = len(fns)
  samples: list[list[float]] = [[] for _ in range(n)]
  errors: dict[int, str] = {}
  for r in range(max(1, rounds)):
    for k in range(n):
      i = (k + r) % n
      if i in errors:
        continue
      try:
        jax.block_until_ready(fns[i](*args))
        samples[i].append(_round_ms(fns[i], args, iters))
      except Exception as e:  # pylint: disable=broad-except
        errors[i] = f"{type(e).__name__}: {e}"[:500]
  medians = [None if i in errors else statistics.median(s)
             for i, s in enumerate(samples)]
  return medians, errors


def check_knobs(*, margin, warmup, rounds, iters) -> None:
  """ValueError naming the argument, for a ``margin`` outside [0, 1) or a
  ``warmup``, ``rounds`` or ``iters`` that is not a positive int."""
  if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not (
      0.0 <= margin < 1.0):
    raise ValueError(f"margin={margin!r} must be a fraction in [0, 1).")
  for name, v in (("warmup", warmup), ("rounds", rounds), ("iters", iters)):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
      raise ValueError(f"{name}={v!r} must be a positive int.")


def _check_only_axis_shards(op, x, mesh, axis_name) -> None:
  """Refuses an ``x`` that the model shards over other axes of ``mesh``
  too (batch over "dp", say): autotune times the op with x sharded over
  ``axis_name`` alone, so its shapes, and the cache key, would be another
  problem than the one the model runs, and the entry would never be used."""
  spec = getattr(getattr(x, "sharding", None), "spec", None)
  if spec is None:
    return
  used = {a for e in spec if e is not None
          for a in (e if isinstance(e, tuple) else (e,))}
  others = sorted(a for a in used - {axis_name}
                  if a in mesh.shape and mesh.shape[a] > 1)
  if others:
    raise ValueError(
        f"autotune: x {tuple(x.shape)} is sharded over {others} besides"
        f" {axis_name!r} (spec {spec}), but {op} is timed with it sharded"
        f" over {axis_name!r} alone, a different problem than the model's:"
        f" pass one {others[0]!r} group's operand (x of that group's shape,"
        " unsharded or on a mesh of the tensor-parallel axis alone), or"
        " tune the whole model with ficco_jax.autotune_model.")


def _local_shapes(op, x, w, p, axis):
  x_local = list(x.shape)
  if op == "all_gather_matmul":
    x_local[axis] //= p
    return tuple(x_local), (w.shape[0], w.shape[1] // p)
  x_local[-1] //= p
  return tuple(x_local), (w.shape[0] // p, w.shape[1])


# Beyond the cost model's candidates, the push all-gather (which it models
# as direct/c1 on XLA's dots). Pallas variants timed by default: the one-
# and two-chunk copy-engine schedules at every granularity (what the
# shipped H200 cache holds, e.g. direct/c2/dma/pallas/step; more chunks
# were never faster there), and the flagged granularity of each op (the
# reduce-scatter's kernel that signals the copies, the signalled
# all-gather's kernel that waits on landing flags), which the cost model
# does not predict.
_PALLAS_CHUNKS = (1, 2)


def _default_candidates(op, x_local, w_local, dtype, p, axis, platform,
                        device=None):
  comms = ("xla",) + (("dma",) if heuristics.dma_available(platform) else ())
  prob = cost_model.problem(op, x_shape=x_local, w_shape=w_local, dtype=dtype,
                            axis_size=p, axis=axis)
  out = list(cost_model.candidates(prob, comms))
  push = ((heuristics.PUSH_GATHER,)
          if op == "all_gather_matmul" and "dma" in comms and p > 1 else ())
  if (device is None or "dma" not in comms
      or not pallas_config.hopper_kernel_runs(device, dtype)):
    return tuple(out) + push
  for s in tuple(out):
    if s.comm == "dma" and s.num_chunks in _PALLAS_CHUNKS:
      out.append(dataclasses.replace(s, compute="pallas"))
      if s.dataflow == "direct" and s.compute_granularity is None:
        out.append(dataclasses.replace(s, compute="pallas",
                                       compute_granularity="flagged"))
  return tuple(out) + push


def _moe_setup(op, x, w, group_sizes, *, mesh, axis_name, op_kwargs, device):
  """A MoE op's local shapes, default candidates and candidate -> program
  (`ficco_jax.sharded`'s form on ``(x, w, group_sizes)``)."""
  # pylint: disable-next=g-import-not-at-top
  from ficco_jax._src.ops.moe import api as moe_api
  from ficco_jax._src.ops.moe import sharded as moe_sharded  # pylint: disable=g-import-not-at-top
  p = mesh.shape[axis_name]
  taken = set(inspect.signature(getattr(moe_api, op)).parameters) - {
      "x", "h", "w", "group_sizes", "axis_name", "schedule"}
  unknown = set(op_kwargs) - taken
  if unknown:
    raise ValueError(f"autotune: op_kwargs {sorted(unknown)} are not {op}'s"
                     f" to set here; it takes {sorted(taken)} (mesh,"
                     " axis_name and schedule are autotune's).")
  if getattr(group_sizes, "shape", None) != (p, w.shape[0]):
    raise ValueError(f"autotune: group_sizes must be [{p}, {w.shape[0]}]"
                     f" (a row of counts per device of {axis_name!r}, one"
                     f" per expert of w {tuple(w.shape)}), got shape"
                     f" {tuple(getattr(group_sizes, 'shape', ()))}.")
  for name, a in (("x", x), ("w", w)):
    if a.shape[0] % p:
      raise ValueError(f"autotune: {name}.shape[0] = {a.shape[0]} ({name} is"
                       f" {tuple(a.shape)}) must be a multiple of the size"
                       f" {p} of {axis_name!r}.")
  x_local = (x.shape[0] // p, *x.shape[1:])
  w_local = (w.shape[0] // p, *w.shape[1:])
  kernel_runs = device.platform == "gpu" and moe_heuristic.kernel_unfit(
      w_shape=w_local, dtype=x.dtype, w_dtype=w.dtype,
      out_dtype=op_kwargs.get("preferred_element_type"),
      precision=op_kwargs.get("precision"),
      hopper=pallas_config.hopper_kernel_runs(device, x.dtype),
      device_desc=device.device_kind) is None
  # The MoE copy-engine dataflow is not tested across processes (the
  # heuristic never picks it there either).
  cands = moe_heuristic.candidates(
      kernel_runs=kernel_runs,
      dma=(heuristics.dma_available(device.platform) and p > 1
           and jax.process_count() == 1))
  fn_of = getattr(moe_sharded, op)
  make = lambda s: jax.jit(functools.partial(  # noqa: E731
      fn_of, mesh=mesh, axis_name=axis_name, schedule=s, **op_kwargs))
  return x_local, w_local, cands, make


def autotune(
    op: str,
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    axis: int = 0,
    candidates: Sequence[schedule_lib.Schedule] | None = None,
    store: bool = True,
    warmup: int = 3,
    rounds: int = 5,
    iters: int = 10,
    margin: float = 0.0,
    group_sizes: jax.Array | None = None,
    op_kwargs: dict[str, Any] | None = None,
) -> AutotuneResult:
  """Times candidate schedules of one op on ``mesh`` and caches the fastest.

  Later calls with ``schedule=None`` and the same local shapes, dtype, axis
  size and device kind run the cached schedule (see `set_autotune_cache`);
  functions already traced keep theirs.

  Args:
    op: ``"all_gather_matmul"``, ``"matmul_reduce_scatter"``, or a MoE op
      (``"all_to_all_matmul"``, ``"matmul_all_to_all"``: timed with the
      routing ``group_sizes`` and ``op_kwargs`` given, which the cache key
      does not hold: tune with a routing like the one the model sees).
    x: the global first operand, as for `ficco_jax.sharded.all_gather_matmul`
      (``x``), `ficco_jax.sharded.matmul_reduce_scatter` (``h``) or the
      MoE ops' sharded forms.
    w: the global weight (the MoE ops: ``[P * E_l, ., .]``).
    mesh: the mesh to run on.
    axis_name: the tensor-parallel axis.
    axis: ``gather_axis`` / ``scatter_axis``.
    candidates: schedules to time; default: ``"none"`` and every valid
      dataflow x chunk count x engine (``"dma"`` only where it runs), the
      push all-gather (``direct/c1/dma/xla/flagged``, where ``"dma"``
      runs), and, where ficco's Pallas kernel runs (sm_90, bf16/f16), the
      one- and two-chunk copy-engine schedules (every granularity) with
      ``compute="pallas"``, ``"flagged"`` among them (the reduce-scatter's
      signalling kernel, the signalled all-gather).
    store: write the result into the user cache file.
    warmup: untimed calls per candidate (the first compiles).
    rounds: timed rounds; the median round counts. Every candidate is
      compiled and warmed up first, then each round times every candidate
      once, round-robin, so a drift of the host or the devices over the
      search does not pick the winner.
    iters: back-to-back calls per round. A candidate that fails while
      being timed is dropped from the rounds and listed in ``errors``.
    margin: keep ``"none"`` (XLA's own program) unless the fastest candidate
      beats it by this fraction of its time (e.g. 0.03: 3% faster); only
      when ``"none"`` is among the candidates. 0 picks the fastest. For
      the MoE ops the kept one is the fastest ``dataflow="none"``
      candidate, whichever its experts' compute: the margin guards the
      exchange's decomposition, not the kernel.
    group_sizes: the MoE ops only (required there): the global ``[P, P *
      E_l]`` routing counts, as for their sharded forms.
    op_kwargs: the MoE ops only: their other arguments (``capacity``,
      ``piece_capacity``, ``num_tokens``, ``precision``, ...), passed to
      every candidate; ``check_routing`` defaults to False while timing.
      The MoE candidates by default: each dataflow (``none``, ``direct``,
      and ``direct`` on the copy engines where they run) with the experts
      on ``ragged_dot`` and, where the GPU grouped kernel takes the call, on
      the kernel.

  Returns:
    An `AutotuneResult`. Candidates that fail (e.g. a ``num_chunks`` that
    does not divide) are listed in ``errors``.

  Raises:
    ValueError: for an unknown ``op`` or ``axis_name``, a ``margin`` outside
      [0, 1), or a ``warmup``, ``rounds`` or ``iters`` below 1.
    OSError: with ``store=True``, before any timing, when the cache file
      cannot be written (a failure to store after timing is returned in
      ``store_error`` instead).
    RuntimeError: when no candidate ran.
  """
  moe = op in moe_heuristic.OPS
  if op not in cost_model.OPS and not moe:
    raise ValueError(f"Unknown {op=}; expected one of"
                     f" {cost_model.OPS + moe_heuristic.OPS}.")
  if moe and group_sizes is None:
    raise ValueError(f"autotune: {op} needs group_sizes, the global [P,"
                     " P * E_l] routing counts it is timed with.")
  if not moe and (group_sizes is not None or op_kwargs):
    raise ValueError(f"autotune: group_sizes and op_kwargs are the MoE ops'"
                     f" arguments; {op} takes neither.")
  check_knobs(margin=margin, warmup=warmup, rounds=rounds, iters=iters)
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{axis_name=} is not an axis of {mesh.axis_names}.")
  if store:
    # Before any timing: a search whose result cannot be kept should say
    # so in seconds, not after minutes.
    autotune_cache.check_writable()
  p = mesh.shape[axis_name]
  device = mesh.devices.flat[0]
  # The dtype the op resolves its schedule for: the tensor-parallel ops
  # promote x with w first (bf16 activations with f32 weights look up
  # float32), the MoE ops take x's.
  dtype = x.dtype if moe else jnp.result_type(x, w)
  if moe:
    if axis != 0:
      raise ValueError(f"autotune: {op} exchanges rows (axis 0); got"
                       f" {axis=}.")
    axis, args = 0, (x, w, group_sizes)
    x_local, w_local, default, make = _moe_setup(
        op, x, w, group_sizes, mesh=mesh, axis_name=axis_name,
        op_kwargs={"check_routing": False, **(op_kwargs or {})},
        device=device)
  else:
    # The sharded form's own checks, before any key is built or candidate
    # compiled: the errors name the global arrays passed here.
    axis = sharded.specs(op, x, w, mesh=mesh, axis_name=axis_name, axis=axis,
                         spec=None)[0]
    args = (x, w)
    _check_only_axis_shards(op, x, mesh, axis_name)
    x_local, w_local = _local_shapes(op, x, w, p, axis)
    default = None
    axis_kw = {("gather_axis" if op == "all_gather_matmul"
                else "scatter_axis"): axis}
    make = lambda s: jax.jit(functools.partial(  # noqa: E731
        getattr(sharded, op), mesh=mesh, axis_name=axis_name, schedule=s,
        **axis_kw))
  key = autotune_cache.Key.of(op, device_kind=device.device_kind,
                              axis_size=p, x_shape=x_local, w_shape=w_local,
                              axis=axis, dtype=dtype,
                              processes=jax.process_count())
  if candidates is None:
    candidates = default or _default_candidates(
        op, x_local, w_local, dtype, p, axis, device.platform, device)
  fns, errors = {}, {}
  for s in dict.fromkeys(candidates):  # Unique, in order.
    fn = make(s)
    try:
      warm(fn, args, warmup)
      fns[s] = fn
    except Exception as e:  # pylint: disable=broad-except
      # One bad candidate must not end the search.
      errors[s.short()] = f"{type(e).__name__}: {e}"[:500]
  timings = {}
  if fns:
    medians, failed = time_interleaved(list(fns.values()), args,
                                       rounds=rounds, iters=iters)
    for i, (s, t) in enumerate(zip(fns, medians)):
      if i in failed:
        errors[s.short()] = failed[i]
      else:
        timings[s] = t
  if not timings:
    raise RuntimeError(f"autotune: no candidate ran for {key}: {errors}")
  ranked = sorted(timings.items(), key=lambda kv: kv[1])
  best = ranked[0][0]
  # "none" is XLA's own program whatever its comm/compute fields say.
  nones = [s for s, _ in ranked if s.dataflow == "none"]
  if nones and timings[best] > timings[nones[0]] * (1.0 - margin):
    best = nones[0]  # Not faster than XLA's own program by the margin.
  table = tuple((s.short(), float(t)) for s, t in ranked)
  cache_file = store_error = None
  if store:
    try:
      cache_file = str(autotune_cache.store(key, best,
                                            timings_ms=dict(table)))
    except OSError as e:
      # The measurements are worth more than the file: return them.
      store_error = str(e)
      heuristics.log.warning("ficco_jax.autotune: %s", e)
  return AutotuneResult(key=key, best=best, timings_ms=table,
                        errors=tuple(errors.items()), cache_file=cache_file,
                        store_error=store_error)

