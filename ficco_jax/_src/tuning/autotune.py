"""Measure candidate schedules on the devices at hand and cache the fastest."""

from __future__ import annotations

import dataclasses
import functools
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
# were never faster there), and the reduce-scatter's flagged granularity,
# which the cost model does not predict.
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
      if (op == "matmul_reduce_scatter" and s.dataflow == "direct"
          and s.compute_granularity is None):
        out.append(dataclasses.replace(s, compute="pallas",
                                       compute_granularity="flagged"))
  return tuple(out) + push


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
) -> AutotuneResult:
  """Times candidate schedules of one op on ``mesh`` and caches the fastest.

  Later calls with ``schedule=None`` and the same local shapes, dtype, axis
  size and device kind run the cached schedule (see `set_autotune_cache`);
  functions already traced keep theirs.

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    x: the global first operand, as for `ficco_jax.sharded.all_gather_matmul`
      (``x``) or `ficco_jax.sharded.matmul_reduce_scatter` (``h``).
    w: the global weight.
    mesh: the mesh to run on.
    axis_name: the tensor-parallel axis.
    axis: ``gather_axis`` / ``scatter_axis``.
    candidates: schedules to time; default: ``"none"`` and every valid
      dataflow x chunk count x engine (``"dma"`` only where it runs), and,
      where ficco's Pallas kernel runs (sm_90, bf16/f16), the one- and
      two-chunk copy-engine schedules (every granularity) with
      ``compute="pallas"`` and the reduce-scatter's ``"flagged"``
      granularity.
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
      when ``"none"`` is among the candidates. 0 picks the fastest.

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
  if op not in cost_model.OPS:
    raise ValueError(f"Unknown {op=}; expected one of {cost_model.OPS}.")
  check_knobs(margin=margin, warmup=warmup, rounds=rounds, iters=iters)
  if axis_name not in mesh.axis_names:
    raise ValueError(f"{axis_name=} is not an axis of {mesh.axis_names}.")
  if store:
    # Before any timing: a search whose result cannot be kept should say
    # so in seconds, not after minutes.
    autotune_cache.check_writable()
  p = mesh.shape[axis_name]
  axis = axis % x.ndim
  x_local, w_local = _local_shapes(op, x, w, p, axis)
  device = mesh.devices.flat[0]
  key = autotune_cache.Key.of(op, device_kind=device.device_kind,
                              axis_size=p, x_shape=x_local, w_shape=w_local,
                              axis=axis, dtype=x.dtype,
                              processes=jax.process_count())
  if candidates is None:
    candidates = _default_candidates(op, x_local, w_local, x.dtype, p, axis,
                                     device.platform, device)
  fn_of = getattr(sharded, op)
  axis_kw = "gather_axis" if op == "all_gather_matmul" else "scatter_axis"
  fns, errors = {}, {}
  for s in dict.fromkeys(candidates):  # Unique, in order.
    fn = jax.jit(functools.partial(fn_of, mesh=mesh, axis_name=axis_name,
                                   schedule=s, **{axis_kw: axis}))
    try:
      warm(fn, (x, w), warmup)
      fns[s] = fn
    except Exception as e:  # pylint: disable=broad-except
      # One bad candidate must not end the search.
      errors[s.short()] = f"{type(e).__name__}: {e}"[:500]
  timings = {}
  if fns:
    medians, failed = time_interleaved(list(fns.values()), (x, w),
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

