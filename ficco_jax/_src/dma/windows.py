"""Symmetric windows for the copy-engine path: made once, at lowering time.

The window transport (docs/windows.md) needs, on every device of a
gathered axis, a window of memory that every peer has mapped, per start call
site. They are created here when a program that needs them is lowered, and
their handles travel between processes through JAX's distributed key-value
store (in one process, nothing travels: peers map each other's windows
directly). A *family* is the set of windows of one call site over one group
layout; the lowered custom call names it, and each device's handler finds
its own window in it.

All processes of a job lower the same programs in the same order (SPMD), so
they create the same families in the same order; keys in the store carry
the group's device ids and a generation (the count of families made for
that group), so they match across processes: every member of a group
lowers the same starts over it, whatever other groups a process also
holds. A family lives as long as the process unless a failure poisons it:
each start of a program of the window transport holds one copy of its
sources per device, shared by the program's later traces (`family_for`);
the push protocol's sites share a pool (`pooled_family`). A poisoned family
that lowering replaces is retired and freed once nothing uses it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import socket
import threading

import jax
import numpy as np

from ficco_jax._src.dma import library

_HANDLE_BYTES = 256
# How long lowering waits for peer processes to publish their windows.
EXCHANGE_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Family:
  id: int
  slot_bytes: int
  generations: tuple[int, ...]  # per local group, in order


_lock = threading.Lock()
# (platform, groups, program name, k, slot bytes) -> the family of the k-th
# window-transport start of the last program lowered that way.
_families: dict[tuple, Family] = {}
_generations: dict[tuple, int] = {}
_next_id = [1]
_hosts: dict[int, str] = {}  # process index -> host name


def hostname() -> str:
  """This process's host, as the other processes of the job will see it
  (tests of the other-host refusal replace it: their processes share one
  machine)."""
  return socket.gethostname()


class _Directory:
  """Publish/lookup of small strings: the job's key-value store when there
  are several processes, a dict in one."""

  def __init__(self):
    self._local: dict[str, str] = {}

  @staticmethod
  def _client():
    from jax._src import distributed  # pylint: disable=g-import-not-at-top

    client = distributed.global_state.client
    if client is None:
      raise ValueError(
          "comm='dma' across processes needs jax.distributed.initialize()"
          " (its key-value store carries the window handles); use"
          " Schedule(comm='xla') otherwise.")
    return client

  def set(self, key: str, value: str) -> None:
    if jax.process_count() == 1:
      self._local[key] = value
    else:
      self._client().key_value_set(key, value)

  def get(self, key: str, timeout_s: float, what: str = "") -> str:
    """The value of ``key``, once published; ``what`` names it (and who
    should publish it) in the error when it is not within ``timeout_s``."""
    if jax.process_count() == 1:
      return self._local[key]
    try:
      return self._client().blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # pylint: disable=broad-exception-caught
      if not what:
        raise
      raise RuntimeError(
          f"ficco window exchange: {what} did not come within"
          f" {timeout_s:.0f} s (key {key!r}). Every process of the job must"
          " lower the same programs in the same order, and after a failure"
          " every process must lower again (jax.clear_caches(), then call):"
          " a process that lowers again alone waits here. If one process"
          " already did, their windows no longer pair: restart the job."
          f" ({type(e).__name__}: {e})") from e


_directory = _Directory()


def _call(fn, *args):
  err = ctypes.create_string_buffer(1024)
  if fn(*args, err, ctypes.c_int64(len(err))):
    raise RuntimeError(f"ficco window: {err.value.decode()}")


@functools.cache
def _lib():
  lib = library.load()
  i64, pi64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
  lib.FiccoWindowCreate.argtypes = [
      ctypes.c_int, i64, ctypes.c_int, i64, i64, pi64, i64, ctypes.c_char_p,
      pi64, ctypes.c_char_p, i64]
  lib.FiccoWindowMap.argtypes = [
      ctypes.c_int, i64, ctypes.c_int, i64, ctypes.c_int, ctypes.c_char_p,
      i64, ctypes.c_char_p, i64]
  lib.FiccoWindowSealed.argtypes = [ctypes.c_int, i64, ctypes.c_int]
  lib.FiccoWindowSealed.restype = None
  lib.FiccoWindowEpoch.argtypes = [ctypes.c_int, i64, ctypes.c_int]
  lib.FiccoWindowEpoch.restype = i64
  lib.FiccoWindowPoisoned.argtypes = [ctypes.c_int, i64, ctypes.c_int]
  lib.FiccoWindowCount.argtypes = [ctypes.c_int]
  lib.FiccoWindowCount.restype = i64
  lib.FiccoWindowPending.argtypes = [ctypes.c_int]
  lib.FiccoWindowPending.restype = i64
  lib.FiccoWindowForget.argtypes = [ctypes.c_int, i64]
  lib.FiccoWindowForget.restype = None
  lib.FiccoWindowRetire.argtypes = [ctypes.c_int, i64, ctypes.c_char_p]
  lib.FiccoWindowRetire.restype = None
  lib.FiccoWindowReap.argtypes = [ctypes.c_int]
  lib.FiccoWindowReap.restype = i64
  return lib


def handler_ordinal(device, platform: int) -> int:
  """The DeviceOrdinal an FFI handler sees for ``device``: the CUDA ordinal
  in this process on GPUs, the global id on XLA:CPU (which numbers the
  devices of process k from k * 2048)."""
  return device.id if platform == library.platform_id("cpu") else (
      device.local_hardware_id)


def axis_groups(mesh: jax.sharding.Mesh, axis_name: str) -> list[list]:
  """The device groups along ``axis_name`` (rank = position on the axis)."""
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), -1)
  return [list(g) for g in devices.reshape(-1, devices.shape[-1])]


def spans_processes(mesh: jax.sharding.Mesh, axis_name: str) -> bool:
  here = jax.process_index()
  return any(d.process_index != here
             for g in axis_groups(mesh, axis_name)
             if any(d.process_index == here for d in g) for d in g)


def _check_one_host(groups, axis_name: str, timeout_s: float) -> None:
  procs = sorted({d.process_index for g in groups for d in g})
  if len(procs) == 1:
    return
  me = jax.process_index()
  if me not in _hosts:  # Published once per process.
    _hosts[me] = hostname()
    _directory.set(f"ficco/host/{me}", _hosts[me])
  for p in procs:
    if p not in _hosts:
      _hosts[p] = _directory.get(f"ficco/host/{p}", timeout_s,
                                 f"the host name of process {p}")
  hosts = {p: _hosts[p] for p in procs}
  if len(set(hosts.values())) > 1:
    where = ", ".join(f"process {p} on {h!r}" for p, h in sorted(hosts.items()))
    raise ValueError(
        f"comm='dma' needs every device of axis {axis_name!r} on one host"
        f" (copy engines reach peers over NVLink, not the network); the"
        f" axis spans {where}. Use Schedule(comm='xla') for this axis.")


def _local_groups(mesh: jax.sharding.Mesh, axis_name: str):
  """This process's groups of ``axis_name`` and their device-id signature."""
  here = jax.process_index()
  groups = [g for g in axis_groups(mesh, axis_name)
            if any(d.process_index == here for d in g)]
  return groups, tuple(tuple(int(d.id) for d in g) for g in groups)


def _retire(fam: Family, platform: int, why: str) -> None:
  """Takes a family that lowering replaced out of use: its windows here are
  poisoned (a program still compiled against it fails, saying to lower
  again) and freed by a later `_new_family` once no call holds them."""
  _lib().FiccoWindowRetire(platform, fam.id, why.encode())


def _new_family(groups, sig, axis_name: str, slot_bytes: int,
                platform: int) -> Family:
  """Creates (and exchanges) a family; the caller holds `_lock`."""
  # Lowering is where families come and go: free the retired ones whose
  # calls have all ended first, so a loop that recovers from failures by
  # lowering again holds at most the families of its last failure.
  _lib().FiccoWindowReap(platform)
  _check_one_host(groups, axis_name, EXCHANGE_TIMEOUT_S)
  gens = []
  for g in sig:
    gens.append(_generations.get((platform, g), 0) + 1)
    _generations[(platform, g)] = gens[-1]
  fam = Family(id=_next_id[0], slot_bytes=slot_bytes, generations=tuple(gens))
  _next_id[0] += 1
  try:
    _create_and_map(fam, groups, platform)
  except BaseException:
    # The windows made so far go (and their shared-memory names with them).
    _retire(fam, platform, "its windows could not all be made")
    _lib().FiccoWindowReap(platform)
    raise
  return fam


def family_for(mesh: jax.sharding.Mesh, axis_name: str, *, site: int,
               slot_bytes: int, platform: int, program: dict,
               name: str) -> Family:
  """The window family of start call site ``site`` over this process's
  groups of ``axis_name``, with a slot of ``slot_bytes``; creates (and
  exchanges) one if needed.

  Every trace of a program (after ``jax.clear_caches()``, under a new
  ``jax.jit`` wrapper) makes new sites, but lowers the same starts in the
  same order: the k-th start of program ``name`` with a slot of
  ``slot_bytes`` reuses the family of the last program lowered that way,
  unless a failure poisoned it, so re-tracing maps no new windows. A
  poisoned family is retired (`_retire`) and its memory freed once its
  calls have ended. Distinct
  starts of one program never share (XLA may interleave independent ops, and
  their epochs would pair wrongly); two programs that share a family run
  one after the other on each device when one thread dispatches them, as
  one site run twice does.

  Args:
    mesh, axis_name: the mesh and the axis whose groups share a window.
    site: the start's call site (`peer_copy.new_site`).
    slot_bytes: the slot the start needs (its sources, 256-byte aligned).
    platform: `library.platform_id` of the lowering.
    program: a dict that lives exactly as long as the program being
      lowered (`primitives.program_state`).
    name: the program's name (`primitives.program_name`).

  Returns:
    The family; `program_family` gives it back for the site's waits and
    done.
  """
  groups, sig = _local_groups(mesh, axis_name)
  with _lock:
    sites = program.setdefault((platform, sig), {})
    fam = sites.get(site)
    if fam is not None:  # The site lowered again in this program.
      return fam
    key = (platform, sig, name, len(sites), slot_bytes)
    fam = _families.get(key)
    if fam is not None and _poisoned(fam, groups, platform):
      _retire(fam, platform, f"program {name!r} was lowered again after a"
              " failure poisoned this window")
      # Out of the cache before the new one exists: if making it fails,
      # the next lowering tries again rather than reuse the retired one.
      del _families[key]
      fam = None
    if fam is None:
      fam = _new_family(groups, sig, axis_name, slot_bytes, platform)
      _families[key] = fam
    sites[site] = fam
    return fam


# The k-th pooled site of any program over a group layout -> its family.
_pool: dict[tuple, Family] = {}
# Per group layout: pool families a larger one replaced (programs compiled
# against them still use them).
_outgrown: dict[tuple, list[Family]] = {}


def pooled_family(mesh: jax.sharding.Mesh, axis_name: str, *, site: int,
                  slot_bytes: int, platform: int, program: dict) -> Family:
  """A window family for ``site`` from a pool shared by every program.

  Distinct sites of one program get distinct families: XLA may interleave
  the custom calls of two independent ops of one program, and two epochs in
  flight on one window would land in each other's halves. But each device
  runs one program's custom calls before the next program's (its host
  thread launches them in dispatch order, its stream runs them so), so the
  k-th site of every program shares the k-th pooled family. This assumes
  one thread dispatches the programs that share devices: two threads
  dispatching at once could order them differently on two devices.

  A family too small for a later program is replaced by one of at least
  twice its slot (the outgrown one stays, for the programs compiled against
  it), so the windows of an ordinal add up to at most twice the last; and a
  failure anywhere in the pool (a poisoned family) replaces every family of
  the group's pool, outgrown ones included, since the failed program may
  have left its other windows with ranks at different epochs: they are
  retired (a program still compiled against one fails, saying to lower
  again) and freed once their calls have ended.

  Args:
    mesh, axis_name: the mesh and the axis whose groups share a window.
    site: the op's call site (`peer_copy.new_site`).
    slot_bytes: the least slot the op needs (a multiple of 512: two halves
      of `push.half_bytes`).
    platform: `library.platform_id` of the lowering.
    program: a dict that lives exactly as long as the program being
      lowered (its sites' ordinals and families).

  Returns:
    The family; `program_family` gives it back for the site's later steps.
  """
  groups, sig = _local_groups(mesh, axis_name)
  with _lock:
    sites = program.setdefault((platform, sig), {})
    fam = sites.get(site)
    if fam is not None:  # The site lowered again in this program.
      return fam
    mine = [k for k in _pool if k[:2] == (platform, sig)]
    pool = [_pool[k] for k in mine] + _outgrown.get((platform, sig), [])
    # Checked once per program, before its first site.
    if not sites and any(_poisoned(f, groups, platform) for f in pool):
      for k in mine:
        _pool.pop(k)
      for f in pool:
        _retire(f, platform, "a failure poisoned a window of this group's"
                " push pool, so the pool was replaced")
      _outgrown.pop((platform, sig), None)
    key = (platform, sig, len(sites))
    fam = _pool.get(key)
    if fam is None or fam.slot_bytes < slot_bytes:
      grown = max(slot_bytes, 2 * fam.slot_bytes) if fam else slot_bytes
      made = _new_family(groups, sig, axis_name, grown, platform)
      if fam is not None:
        _outgrown.setdefault((platform, sig), []).append(fam)
      fam = _pool[key] = made
    sites[site] = fam
    return fam


def program_family(mesh: jax.sharding.Mesh, axis_name: str, *, site: int,
                   platform: int, program: dict, first: str,
                   later: str) -> Family:
  """The family `family_for` or `pooled_family` gave ``site`` in this
  program, for the steps lowered after its first (in the same module).

  Args:
    mesh, axis_name, site, platform, program: as given to the first step.
    first, later: the site's first step and its later ones, for the error
      when the first was not lowered in this program (e.g. "arm" and
      "start or finish").

  Returns:
    The family.
  """
  _, sig = _local_groups(mesh, axis_name)
  with _lock:
    fam = program.get((platform, sig), {}).get(site)
  if fam is None:
    raise ValueError(
        f"site {site}: its {later} is lowered without its {first} in this"
        f" program; pass each {first}'s site to its own {later}.")
  return fam


def _poisoned(fam: Family, groups, platform: int) -> bool:
  """Whether a window of ``fam`` here is poisoned (or a peer's is: the
  library reads their marks), or gone (-1: retired)."""
  here = jax.process_index()
  return any(_lib().FiccoWindowPoisoned(
      platform, fam.id, handler_ordinal(d, platform)) != 0
             for g in groups for d in g if d.process_index == here)


def _create_and_map(fam: Family, groups, platform: int) -> None:
  lib, here = _lib(), jax.process_index()
  gen = {id(g): fam.generations[i] for i, g in enumerate(groups)}
  tag = lambda g: "-".join(str(d.id) for d in g) + f"/{gen[id(g)]}"
  mine = [(g, r, d) for g in groups for r, d in enumerate(g)
          if d.process_index == here]
  for g, r, d in mine:
    ids = (ctypes.c_int64 * len(g))(*[d2.id for d2 in g])
    handle = ctypes.create_string_buffer(_HANDLE_BYTES)
    n = ctypes.c_int64(_HANDLE_BYTES)
    _call(lib.FiccoWindowCreate, platform, fam.id, handler_ordinal(d, platform), r,
          len(g), ids, fam.slot_bytes, handle, ctypes.byref(n))
    _directory.set(
        f"ficco/window/{tag(g)}/{r}",
        json.dumps({"process": here, "local": handler_ordinal(d, platform),
                    "handle": handle.raw[:n.value].hex()}))
  for g, r, d in mine:
    for q, peer in enumerate(g):
      if q == r:
        continue
      info = json.loads(_directory.get(
          f"ficco/window/{tag(g)}/{q}", EXCHANGE_TIMEOUT_S,
          f"the window of rank {q} (device {peer.id}, process"
          f" {peer.process_index})"))
      raw = bytes.fromhex(info["handle"])
      same = info["process"] == here
      _call(lib.FiccoWindowMap, platform, fam.id, handler_ordinal(d, platform), q,
            info["local"] if same else -1, raw, len(raw))
  # Every peer has mapped every window before any name is dropped.
  for g, r, d in mine:
    _directory.set(f"ficco/mapped/{tag(g)}/{r}", "1")
  for g, r, d in mine:
    for q, peer in enumerate(g):
      _directory.get(f"ficco/mapped/{tag(g)}/{q}", EXCHANGE_TIMEOUT_S,
                     f"the word that rank {q} (device {peer.id}, process"
                     f" {peer.process_index}) mapped its peers' windows")
    lib.FiccoWindowSealed(platform, fam.id, handler_ordinal(d, platform))


def epoch(family: int, device_ordinal: int, platform: int) -> int:
  """Starts so far on a device's window of ``family`` (-1: no window)."""
  return _lib().FiccoWindowEpoch(platform, family, device_ordinal)


def window_count(platform: int) -> int:
  """Windows whose memory this process holds: in use, retired after a
  failure and not yet freed, or freed but for CUDA device memory that a
  process of another rank maps (docs/windows.md, "Failure and timeouts")."""
  return _lib().FiccoWindowCount(platform)


def pending_entries(platform: int) -> int:
  """wait/done entries of window invocations not yet taken (0 when idle)."""
  return _lib().FiccoWindowPending(platform)
