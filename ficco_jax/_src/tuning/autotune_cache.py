"""Autotuned schedules as data: a JSON cache keyed by what decides the best one.

Two layers, both read lazily on the first lookup:

1. the package's shipped results, ``ficco_jax/data/autotune/<device_kind_slug>.json``
   (measured on that device kind; the benchmark command's ``autotune``
   suite writes it);
2. the user's file, overlaid on top (a user entry wins): the path given to
   `set_autotune_cache`, else ``~/.cache/ficco_jax/autotune.json``.
   `ficco_jax.autotune` writes there. The file is re-read when it changes.

While `ficco_jax.autotune_model` compiles a function with the schedules it
measured, before deciding whether to store them, those entries (`trying`)
come before both.

File format::

  {"format": 1, "comment": "...",
   "entries": [{"key": {"op": ..., "device_kind": ..., "axis_size": 4,
                        "x_shape": [2048, 8192], "w_shape": [8192, 7168],
                        "axis": 0, "dtype": "bfloat16"},
                "schedule": {"dataflow": "direct", "num_chunks": 2, ...},
                "timings_ms": {"direct/c2/dma/xla": 1.41, ...}}]}
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fcntl
import functools
import json
import logging
import os
import pathlib
import threading
import time
from typing import Any, Mapping

import numpy as np

from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src.tuning import device_params

FORMAT = 1
_log = logging.getLogger("ficco_jax")
DEFAULT_PATH = pathlib.Path("~/.cache/ficco_jax/autotune.json")
PACKAGE_DIR = device_params.DATA_DIR / "autotune"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Key:
  """What decides the best schedule: the device, the axis and the local problem.

  Shapes are the local (per-device) shapes the op sees inside ``shard_map``.
  ``processes`` is the job's process count: with one process driving every
  GPU the copy engines run the rendezvous transport, with several the
  window transport (docs/windows.md), whose costs differ, so a result
  measured in one layout does not stand for the other (the flagged
  granularity pushes in either). The shipped results were all measured in
  one process. In JSON it is omitted when 1.
  """

  op: str
  device_kind: str
  axis_size: int
  x_shape: tuple[int, ...]
  w_shape: tuple[int, ...]
  axis: int
  dtype: str
  processes: int = 1

  @classmethod
  def of(cls, op: str, *, device_kind: str, axis_size: int, x_shape, w_shape,
         axis: int, dtype, processes: int = 1) -> "Key":
    return cls(op=op, device_kind=device_kind, axis_size=int(axis_size),
               x_shape=tuple(int(d) for d in x_shape),
               w_shape=tuple(int(d) for d in w_shape), axis=int(axis),
               dtype=np.dtype(dtype).name, processes=int(processes))

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["x_shape"], d["w_shape"] = list(self.x_shape), list(self.w_shape)
    if self.processes == 1:
      del d["processes"]
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Key":
    """The key a file's entry stores; ValueError for one that is not
    exactly what `to_json` writes (a shape of floats or a string is not
    read as some other shape)."""
    if not isinstance(d, Mapping):
      raise ValueError(f"a key is a JSON object, got {d!r}")
    for name in ("op", "device_kind", "dtype"):
      if not isinstance(d[name], str):
        raise ValueError(f"{name}={d[name]!r} must be a string")
    counts = {name: d[name] for name in ("axis_size", "axis")}
    counts["processes"] = d.get("processes", 1)
    for name, v in counts.items():
      if not _is_int(v) or (name != "axis" and v < 1):
        raise ValueError(f"{name}={v!r} must be an int"
                         + ("" if name == "axis" else " >= 1"))
    for name in ("x_shape", "w_shape"):
      v = d[name]
      if not (isinstance(v, list) and v
              and all(_is_int(n) and n >= 1 for n in v)):
        raise ValueError(f"{name}={v!r} must be a list of ints >= 1")
    return cls.of(d["op"], device_kind=d["device_kind"],
                  axis_size=d["axis_size"], x_shape=d["x_shape"],
                  w_shape=d["w_shape"], axis=d["axis"], dtype=d["dtype"],
                  processes=counts["processes"])


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def schedule_to_json(s: schedule_lib.Schedule) -> dict[str, Any]:
  return dataclasses.asdict(s)


def schedule_from_json(d: Mapping[str, Any]) -> schedule_lib.Schedule:
  """The schedule `schedule_to_json` wrote; it names its dataflow at least
  (an empty object is not read as the default schedule)."""
  if not isinstance(d, Mapping) or "dataflow" not in d:
    raise ValueError(f"a schedule is a JSON object with a dataflow, got {d!r}")
  return schedule_lib.Schedule(**d)


def _parse(data: Any, where: str) -> dict[Key, schedule_lib.Schedule]:
  if not isinstance(data, Mapping):
    raise ValueError(f"{where}: an autotune cache is a JSON object, got"
                     f" {type(data).__name__}.")
  if data.get("format", FORMAT) != FORMAT:
    raise ValueError(f"{where}: unsupported autotune cache format"
                     f" {data.get('format')!r} (expected {FORMAT}).")
  entries = data.get("entries", [])
  if not isinstance(entries, list):
    raise ValueError(f"{where}: 'entries' must be a list.")
  out = {}
  for i, e in enumerate(entries):
    try:
      key, fields = Key.from_json(e["key"]), e["schedule"]
      if not isinstance(fields, Mapping):
        raise ValueError(f"its schedule {fields!r} is not a JSON object")
      fields = dict(fields)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
      raise ValueError(f"{where}: entry {i} is malformed: {err}") from err
    unknown = set(fields) - {f.name for f in dataclasses.fields(
        schedule_lib.Schedule)}
    if unknown:
      raise ValueError(f"{where}: entry {i} is malformed: its schedule has"
                       f" fields no Schedule has: {sorted(unknown)}.")
    try:
      out[key] = schedule_from_json(fields)
    except (TypeError, ValueError) as err:
      # A schedule that an earlier version stored and this one refuses:
      # that entry alone is dropped, not the file's other measurements.
      _log.warning("ficco_jax: %s: entry %d's schedule %s no longer"
                   " validates (%s); skipped, the other entries kept.",
                   where, i, fields, err)
  return out


def _read(path: pathlib.Path) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _load(path: pathlib.Path) -> dict[Key, schedule_lib.Schedule]:
  """The entries of the file at ``path``; ValueError (naming the path) for
  one that does not read as an autotune cache."""
  try:
    data = _read(path)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
    # RecursionError: JSON nested deeper than Python's parser goes.
    raise ValueError(f"{path}: not a JSON autotune cache"
                     f" ({type(err).__name__}: {err}).") from err
  return _parse(data, str(path))


@functools.cache
def _package(device_kind: str) -> dict[Key, schedule_lib.Schedule]:
  path = PACKAGE_DIR / f"{device_params.slug(device_kind)}.json"
  return _load(path) if path.exists() else {}


class _UserCache:
  """The user's file: its path and its contents, re-read when it changes."""

  def __init__(self):
    self._lock = threading.Lock()
    self._path: pathlib.Path | None = None  # None: DEFAULT_PATH.
    self._stamp: tuple[int, int] | None = None
    self._entries: dict[Key, schedule_lib.Schedule] = {}

  @property
  def path(self) -> pathlib.Path:
    return (self._path or DEFAULT_PATH).expanduser()

  def set_path(self, path) -> None:
    with self._lock:
      self._path = None if path is None else pathlib.Path(path)
      self._stamp, self._entries = None, {}

  def entries(self) -> dict[Key, schedule_lib.Schedule]:
    with self._lock:
      path = self.path
      try:
        st = path.stat()
      except FileNotFoundError:
        self._stamp, self._entries = None, {}
        return {}
      stamp = (st.st_mtime_ns, st.st_size)
      if stamp != self._stamp:
        try:
          self._entries = _load(path)
        except (OSError, ValueError) as err:
          # A broken cache must not take every schedule=None call down: it
          # is ignored, once per version of the file, and the user told.
          _log.warning(
              "ficco_jax: ignoring the autotune cache %s (%s); schedule=None"
              " falls back to the shipped cache and the heuristic. Fix or"
              " remove the file, or point ficco_jax.set_autotune_cache()"
              " elsewhere.", path, err)
          self._entries = {}
        self._stamp = stamp
      return dict(self._entries)


_user = _UserCache()


def set_autotune_cache(path: str | os.PathLike | None) -> None:
  """Sets the file autotune results are read from and written to.

  Args:
    path: a JSON file (created by the first `ficco_jax.autotune` that
      stores a result); None restores ``~/.cache/ficco_jax/autotune.json``.
  """
  _user.set_path(path)


def cache_path() -> pathlib.Path:
  """The user cache file in use."""
  return _user.path


_trial: contextvars.ContextVar[Mapping[Key, schedule_lib.Schedule] | None] = (
    contextvars.ContextVar("ficco_jax_trial_entries", default=None))


@contextlib.contextmanager
def trying(entries: Mapping[Key, schedule_lib.Schedule]):
  """Lookups inside the block find ``entries`` first, without writing them
  anywhere: the schedules a function would trace with once they were
  stored."""
  token = _trial.set(dict(entries))
  try:
    yield
  finally:
    _trial.reset(token)


def lookup(key: Key) -> schedule_lib.Schedule | None:
  """The cached schedule for ``key``: entries being tried (`trying`), then
  the user's file, then the package's."""
  hit = (_trial.get() or {}).get(key)
  if hit is None:
    hit = _user.entries().get(key)
  if hit is None:
    hit = _package(key.device_kind).get(key)
  return hit


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """An exclusive lock on ``path``'s sibling lock file, across processes."""
  lock = path.with_name(path.name + ".lock")
  with open(lock, "a", encoding="utf-8") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def check_writable(path: pathlib.Path | None = None) -> pathlib.Path:
  """The cache file `store` would write, once it is known to be writable
  there (its folder made, its lock file opened).

  Raises:
    OSError: naming the path, when it cannot be written.
  """
  path = cache_path() if path is None else pathlib.Path(path)
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
      if path.exists() and not path.is_file():
        raise IsADirectoryError(f"{path} is not a regular file")
      if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"{path} is read-only")
      if not os.access(path.parent, os.W_OK):
        raise PermissionError(f"{path.parent} is not writable")
  except OSError as err:
    raise OSError(
        f"the autotune cache {path} cannot be written ({err}); choose"
        " another with ficco_jax.set_autotune_cache(path).") from err
  return path


def store(key: Key, schedule: schedule_lib.Schedule, *,
          timings_ms: Mapping[str, float] | None = None) -> pathlib.Path:
  """Writes (or replaces) ``key``'s entry in the user cache file.

  Read-modify-write under a lock file, so concurrent writers (threads or
  processes) each keep their entries, and the file is replaced atomically,
  so a reader sees the old or the new file, never half of one. A file that
  does not read as a cache is moved aside (``<name>.corrupt-<time>``) with a
  warning, not rewritten.

  Returns:
    The file written.

  Raises:
    OSError: naming the path, when it cannot be written.
  """
  path = check_writable()
  with _locked(path):
    data: dict[str, Any] = {"format": FORMAT, "entries": []}
    if path.exists():
      try:
        existing = _read(path)
        _parse(existing, str(path))
        data = existing
      except (UnicodeDecodeError, ValueError, RecursionError) as err:
        # Only a file that reads but does not parse: one that cannot be
        # read at all is the caller's to fix (OSError), not to move.
        aside = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
        os.replace(path, aside)
        _log.warning("ficco_jax: the autotune cache %s did not read (%s);"
                     " moved it to %s and started a new one.", path, err,
                     aside)
    data.setdefault("comment", "Written by ficco_jax.autotune.")
    entries = [e for e in data.get("entries", [])
               if Key.from_json(e["key"]) != key]
    entry: dict[str, Any] = {"key": key.to_json(),
                             "schedule": schedule_to_json(schedule)}
    if timings_ms:
      entry["timings_ms"] = {k: float(v) for k, v in timings_ms.items()}
    entries.append(entry)
    data["entries"] = entries
    tmp = path.with_name(
        f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, path)
  return path
