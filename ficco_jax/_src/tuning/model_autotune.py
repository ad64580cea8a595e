"""Autotune every ficco call of a whole function: `ficco_jax.autotune_model`.

A model calls the ops at a handful of shapes; ``schedule=None`` resolves
each through the autotune cache, else the heuristic. This traces the
function once to find those calls, tunes each distinct one with
`autotune.autotune` (on a group of the devices it would run on, with
operands of its local shapes), compiles the function again with the
winners, and times the two programs against each other: a schedule that
wins alone may lose in the step (a site's gradient follows its forward
schedule, and neighbouring work competes for the same engines), so the
entries are stored only when the step is faster with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src.tuning import autotune as autotune_lib
from ficco_jax._src.tuning import autotune_cache
from ficco_jax._src.tuning import heuristics
from ficco_jax._src.tuning import sites as sites_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiteResult:
  """One distinct problem of the function (one autotune-cache key) and
  what tuning it found.

  Attributes:
    site: the op and its local problem (the first call's axis name).
    calls: how many times tracing the function reached a call with this
      key: layers unrolled in Python count each; a ``scan`` body or a
      ``jax.jit`` function JAX traced once, once.
    axis_names: every axis those calls communicate over (the cache key
      has the axis size, not its name).
    before: what ``schedule=None`` ran before tuning.
    before_source: where that came from (``"autotune cache"`` or
      ``"heuristic"``).
    tuned: the site's `ficco_jax.autotune` result (never stored by it).
    devices: ids of the devices it was tuned on.
  """

  site: sites_lib.Site
  calls: int
  axis_names: tuple[str, ...]
  before: schedule_lib.Schedule
  before_source: str
  tuned: autotune_lib.AutotuneResult
  devices: tuple[int, ...]

  @property
  def changed(self) -> bool:
    return self.tuned.best != self.before

  @property
  def speedup(self) -> float | None:
    """The op's time with ``before`` over its time with the tuned schedule,
    when both were timed."""
    t = dict(self.tuned.timings_ms)
    a, b = t.get(self.before.short()), t.get(self.tuned.best.short())
    return None if a is None or b is None or b <= 0 else a / b


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelAutotuneResult:
  """What `autotune_model` measured and kept.

  Attributes:
    sites: one `SiteResult` per distinct call, in trace order.
    step_ms_before: the function's median ms per call with the schedules
      ``schedule=None`` chose before tuning.
    step_ms_after: the same with the tuned schedules (None: no site
      changed, so nothing else was compiled).
    speedup: ``step_ms_before / step_ms_after`` (1.0 when no site changed).
    stored: whether the sites' entries were written to the user cache.
    cache_file: the file written, if any.
    note: why the entries were or were not stored.
  """

  sites: tuple[SiteResult, ...]
  step_ms_before: float
  step_ms_after: float | None
  speedup: float
  stored: bool
  cache_file: str | None
  note: str

  def report(self) -> str:
    """A table of the sites and the step's times, for printing."""
    lines = [f"{'calls':>5}  {'site':<66}  {'before':<28}  {'tuned':<28}"
             f"  {'op gain':>7}"]
    for r in self.sites:
      gain = "" if r.speedup is None else f"{r.speedup:.3f}x"
      where = r.site.describe()
      if len(r.axis_names) > 1:
        where += f" (also over {', '.join(map(repr, r.axis_names[1:]))})"
      lines.append(f"{r.calls:>5}  {where:<66}"
                   f"  {r.before.short():<28}  {r.tuned.best.short():<28}"
                   f"  {gain:>7}")
    after = ("unchanged" if self.step_ms_after is None else
             f"{self.step_ms_after:.3f} ms")
    lines.append(f"step: {self.step_ms_before:.3f} ms before, {after} after"
                 f" ({self.speedup:.3f}x); {self.note}")
    return "\n".join(lines)


def _meshes_of(tree) -> list[jax.sharding.Mesh]:
  """The meshes of the NamedShardings among ``tree``'s arrays."""
  out = []
  for leaf in jax.tree_util.tree_leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh not in out:
      out.append(sharding.mesh)
  return out


def _group(mesh: jax.sharding.Mesh, axis_name: str) -> jax.sharding.Mesh:
  """One group of ``mesh``'s devices along ``axis_name`` (the others' index
  0), as a 1-D mesh: the devices one call of the op spans."""
  i = mesh.axis_names.index(axis_name)
  grid = np.moveaxis(np.asarray(mesh.devices), i, -1)
  return jax.sharding.Mesh(grid.reshape(-1, grid.shape[-1])[0],
                           (axis_name,))


def _tuning_mesh(site: sites_lib.Site, mesh, meshes) -> jax.sharding.Mesh:
  """Where to tune ``site``: a group along its axis of ``mesh`` (which must
  have it), else of the first of ``meshes`` that has that axis at that
  size, else the first ``axis_size`` devices."""
  if mesh is not None:
    if mesh.shape.get(site.axis_name) != site.axis_size:
      raise ValueError(
          f"autotune_model: mesh (axes {dict(mesh.shape)}) has no axis"
          f" {site.axis_name!r} of size {site.axis_size}, which"
          f" {site.describe()} communicates over.")
    return _group(mesh, site.axis_name)
  for m in meshes:
    if m.shape.get(site.axis_name) == site.axis_size:
      return _group(m, site.axis_name)
  visible = jax.devices()
  if len(visible) < site.axis_size:
    raise ValueError(
        f"autotune_model: {site.describe()} needs {site.axis_size} devices;"
        f" {len(visible)} are visible.")
  return jax.sharding.Mesh(np.array(visible[:site.axis_size]),
                           (site.axis_name,))


def _operands(site: sites_lib.Site, mesh: jax.sharding.Mesh, seed: int):
  """Random global operands of ``site``'s local shapes, laid out on ``mesh``
  as `ficco_jax.sharded` takes them (so no call pays a reshard)."""
  p, name = site.axis_size, site.axis_name
  x_shape, w_shape = list(site.x_shape), list(site.w_shape)
  x_spec = [None] * len(x_shape)
  if site.op == "all_gather_matmul":
    x_shape[site.axis] *= p
    w_shape[1] *= p
    x_spec[site.axis] = name
    w_spec = P(None, name)
  else:
    x_shape[-1] *= p
    w_shape[0] *= p
    x_spec[-1] = name
    w_spec = P(name, None)
  dtype = jnp.dtype(site.dtype)

  def normal(key, shape, spec):
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(
        dtype), out_shardings=NamedSharding(mesh, spec))(key)

  kx, kw = jax.random.split(jax.random.key(seed))
  return normal(kx, tuple(x_shape), P(*x_spec)), normal(kw, tuple(w_shape),
                                                         w_spec)


def _time_step(fns, args, *, rounds: int, iters: int):
  """The programs' median ms per call, interleaved (`autotune.time_interleaved`)."""
  return autotune_lib.time_interleaved(fns, args, rounds=rounds, iters=iters)


def _check_arguments(fn, args, fn_kwargs, mesh, candidates) -> None:
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}.")
  if fn_kwargs is not None and not isinstance(fn_kwargs, dict):
    raise TypeError(f"fn_kwargs must be a dict or None, got {fn_kwargs!r}.")
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}.")
  if candidates is not None:
    if not candidates or not all(isinstance(c, schedule_lib.Schedule)
                                 for c in candidates):
      raise ValueError(f"candidates={candidates!r} must be a non-empty"
                       " sequence of ficco_jax.Schedule (or None).")
  for leaf in jax.tree_util.tree_leaves((args, fn_kwargs)):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise TypeError(
          "autotune_model runs fn: pass arrays, not jax.ShapeDtypeStruct"
          f" ({leaf}).")


def _compile(fn, args, kwargs):
  # Traced afresh: JAX's caches would replay the schedules of an earlier
  # trace, and the sites are recorded only while tracing.
  jax.clear_caches()
  return jax.jit(fn).lower(*args, **kwargs).compile()


def autotune_model(
    fn: Callable[..., Any],
    *args: Any,
    fn_kwargs: dict[str, Any] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    candidates: Sequence[schedule_lib.Schedule] | None = None,
    store: bool = True,
    margin: float = 0.03,
    warmup: int = 3,
    rounds: int = 5,
    iters: int = 10,
) -> ModelAutotuneResult:
  """Tunes every ``schedule=None`` ficco call in ``fn`` and times the gain.

  Traces ``jax.jit(fn)(*args, **fn_kwargs)`` to find the calls of
  `ficco_jax.all_gather_matmul` / `ficco_jax.matmul_reduce_scatter` (and
  their `ficco_jax.sharded` forms) that leave the schedule to
  ``schedule=None``, directly or under ``shard_map``, ``jit``, ``grad``,
  ``scan``. Each distinct problem (op, local shapes, dtype, axis size and
  axis: the autotune cache's key) is tuned once with `ficco_jax.autotune`
  on one group of its devices, with random operands of its shapes. Then ``fn`` is compiled with the winners and
  timed against the program it ran before, interleaved; the entries go to
  the user cache (`ficco_jax.set_autotune_cache`) only if the step is
  faster with them. Calls with an explicit ``schedule`` are left alone,
  and so are calls under ``jax.vmap`` (their traced shape is one
  example's, not the work that runs) and the MoE ops (tune those with
  `ficco_jax.autotune`, which takes their routing).

  It clears JAX's compilation caches (``jax.clear_caches``) so that every
  call is traced afresh; functions jitted before it retrace on their next
  call, and then pick up the stored entries. ``fn``'s own donation, if it
  is jitted with ``donate_argnums``, does not apply while tuning: the two
  compiled programs and their outputs are alive at once, so it needs
  memory for about two steps. Calls over an axis of size 1 have nothing to
  overlap and are not tuned.

  Args:
    fn: the function to tune, e.g. a training step; it must be jittable
      with ``args`` and ``fn_kwargs`` as its arguments (bind static
      arguments with ``functools.partial``).
    *args: example arguments (arrays, not ``jax.ShapeDtypeStruct``: ``fn``
      runs), with the shapes, dtypes and shardings it will run with.
    fn_kwargs: keyword arguments of ``fn``, if any.
    mesh: the mesh the ops run on, to pick the devices a call is tuned on
      (a group along its axis; it must have every tuned call's axis).
      Default: the mesh of the first argument sharded over a
      ``NamedSharding`` with that axis at that size, else the first devices
      of ``jax.devices()``.
    candidates: schedules to time at every site (those that do not fit a
      site fail there and are listed in its errors); default
      `ficco_jax.autotune`'s candidates for each site.
    store: write each site's winner to the user cache when the step is
      faster with them (or when no site changed).
    margin: keep a site's ``"none"`` unless a candidate beats it by this
      fraction (`ficco_jax.autotune`'s ``margin``).
    warmup, rounds, iters: as for `ficco_jax.autotune`, for each site and
      for the step.

  Returns:
    A `ModelAutotuneResult`; ``print(result.report())`` shows it.

  Raises:
    TypeError: ``fn`` is not callable, or an argument has the wrong type.
    ValueError: ``fn`` makes no ``schedule=None`` ficco call over an axis
      of size > 1, a knob is out of range, ``mesh`` lacks a call's axis, or
      a call needs more devices than are visible.
    RuntimeError: no candidate ran at a site, or ``fn`` failed when run.
    NotImplementedError: in a job of several processes (tune each op with
      `ficco_jax.autotune` in every process there).
    OSError: with ``store=True``, before any timing, when the cache file
      cannot be written.
  """
  _check_arguments(fn, args, fn_kwargs, mesh, candidates)
  kwargs = dict(fn_kwargs or {})
  if jax.process_count() > 1:
    raise NotImplementedError(
        "autotune_model tunes in one process; in a job of"
        f" {jax.process_count()} processes run ficco_jax.autotune for each"
        " op in every process.")
  autotune_lib.check_knobs(margin=margin, warmup=warmup, rounds=rounds,
                           iters=iters)
  if store:
    autotune_cache.check_writable()  # In seconds, not after the timing.

  with sites_lib.recording() as calls:
    before = _compile(fn, args, kwargs)
  # One tuning per cache key: calls over two axes of one size share it.
  by_key: dict[autotune_cache.Key, list[sites_lib.Call]] = {}
  for c in calls:
    if c.site.axis_size > 1:
      by_key.setdefault(_key(c.site), []).append(c)
  if not by_key:
    raise ValueError(
        f"autotune_model: {getattr(fn, '__name__', fn)!r} makes no"
        " tensor-parallel ficco call with schedule=None over an axis of"
        " size > 1 outside jax.vmap (calls with an explicit schedule are not"
        " tuned, nor are calls under vmap, whose per-example shape is not"
        " the work that runs; the MoE ops are tuned one at a time with"
        " ficco_jax.autotune(op, ..., group_sizes=...)).")
  meshes = _meshes_of((args, kwargs))

  results = []
  for i, group_calls in enumerate(by_key.values()):
    call = group_calls[0]
    site = call.site
    group = _tuning_mesh(site, mesh, meshes)
    x, w = _operands(site, group, seed=i)
    tuned = autotune_lib.autotune(
        site.op, x, w, mesh=group, axis_name=site.axis_name, axis=site.axis,
        candidates=candidates, store=False, warmup=warmup, rounds=rounds,
        iters=iters, margin=margin)
    del x, w
    results.append(SiteResult(
        site=site, calls=len(group_calls),
        axis_names=tuple(dict.fromkeys(c.site.axis_name for c in group_calls)),
        before=call.schedule, before_source=call.source, tuned=tuned,
        devices=tuple(int(d.id) for d in group.devices.flat)))

  # The program before, and (if a site changed) the one with the winners.
  programs = [before]
  changed = any(r.changed for r in results)
  if changed:
    trial = {r.tuned.key: r.tuned.best for r in results}
    try:
      with autotune_cache.trying(trial), sites_lib.recording() as again:
        programs.append(_compile(fn, args, kwargs))
    finally:
      jax.clear_caches()  # Nothing traced with unstored entries stays.
    wrong = [c.site.describe() for c in again
             if c.schedule != trial.get(_key(c.site), c.schedule)]
    if wrong:
      raise RuntimeError(f"autotune_model: the tuned schedules did not apply"
                         f" at {wrong}.")
  flat_args = (args, kwargs)
  fns = [lambda a, kw, f=f: f(*a, **kw) for f in programs]
  for f in fns:
    autotune_lib.warm(f, flat_args, warmup)
  medians, errors = _time_step(fns, flat_args, rounds=rounds, iters=iters)
  if errors:
    raise RuntimeError(f"autotune_model: running {fn!r} failed: {errors}")
  before_ms = medians[0]
  if not changed:
    after_ms, speedup, keep = None, 1.0, True
    note = "no site changed"
  else:
    after_ms = medians[1]
    speedup = before_ms / after_ms
    # Strictly faster: a tie within the timing's noise keeps what ran.
    keep = after_ms < before_ms
    note = ("the step is faster with the tuned schedules" if keep else
            f"the step was not faster with the tuned schedules"
            f" ({after_ms:.3f} ms vs {before_ms:.3f} ms): nothing stored;"
            " pass the sites' schedules explicitly to try them one by one")
  stored, cache_file = False, None
  if store and keep:
    try:
      for r in results:
        cache_file = str(autotune_cache.store(
            r.tuned.key, r.tuned.best, timings_ms=dict(r.tuned.timings_ms)))
      stored = True
      note += f"; stored {len(results)} entries"
    except OSError as e:
      # The measurements are worth more than the file: return them.
      heuristics.log.warning("ficco_jax.autotune_model: %s", e)
      note += f"; storing failed: {e}"
  return ModelAutotuneResult(
      sites=tuple(results), step_ms_before=float(before_ms),
      step_ms_after=None if after_ms is None else float(after_ms),
      speedup=float(speedup), stored=stored, cache_file=cache_file, note=note)


def _key(site: sites_lib.Site) -> autotune_cache.Key:
  return autotune_cache.Key.of(
      site.op, device_kind=site.device_kind,
      axis_size=site.axis_size, x_shape=site.x_shape, w_shape=site.w_shape,
      axis=site.axis, dtype=site.dtype, processes=jax.process_count())
