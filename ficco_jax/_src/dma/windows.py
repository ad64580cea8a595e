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
the group's device ids and a generation (one more than the group's
exchanges completed), so they match across processes: every member of a
group lowers the same starts over it, whatever other groups a process also
holds. An exchange that fails (a peer that never came) does not count: a
process that lowers again alone retries the same generation, and pairs
with its peers once they lower again. Each attempt carries a nonce, and
the ranks agree on the attempt of every window they map (not a stale one
of the same generation) and on its kind and slot (not another program's)
before any is used. A family lives as long as the process unless a
failure poisons it:
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
import secrets
import socket
import threading
import time

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
    """Publishes ``value`` under ``key``, replacing an earlier value (a
    retried exchange publishes its generation's keys again)."""
    if jax.process_count() == 1:
      self._local[key] = value
    else:
      self._client().key_value_set(key, value, allow_overwrite=True)

  def peek(self, key: str) -> str | None:
    """The value of ``key`` now, or None if it is not published."""
    if jax.process_count() == 1:
      return self._local.get(key)
    try:
      return self._client().key_value_try_get(key)
    except Exception:  # pylint: disable=broad-exception-caught
      return None  # NOT_FOUND

  def get(self, key: str, timeout_s: float, what: str = "",
          match=lambda value: True) -> str:
    """The value of ``key`` once published and ``match(value)`` holds: a
    value from an earlier attempt at the same generation (a failed one
    withdraws its keys) may still be there, and its owner replaces it when
    it gets here. ``what`` names the key (and who should publish it) in the
    error when it does not come within ``timeout_s``; ``match`` may raise
    a ValueError for a value that is wrong rather than late."""
    if jax.process_count() == 1:
      value = self._local.get(key)
      if value is None or not match(value):
        # One process publishes every key before reading any.
        raise RuntimeError(f"ficco window exchange: internal error: {what}"
                           f" is missing (key {key!r}).")
      return value
    deadline = time.monotonic() + timeout_s
    try:
      while True:
        left = max(deadline - time.monotonic(), 0.001)
        value = self._client().blocking_key_value_get(key, int(left * 1000))
        if match(value):
          return value
        if time.monotonic() > deadline:
          raise TimeoutError(f"the value of {key!r} never matched")
        time.sleep(0.05)
    except (ValueError, TypeError):
      raise  # From ``match``: the peer's value is wrong, not late.
    except Exception as e:  # pylint: disable=broad-exception-caught
      if not what:
        raise
      raise _late(what, key, timeout_s, f"{type(e).__name__}: {e}") from e


def _late(what: str, key: str, timeout_s: float, cause: str) -> RuntimeError:
  """The error of an exchange that waited ``timeout_s`` for ``what``."""
  return RuntimeError(
      f"ficco window exchange: {what} did not come within"
      f" {timeout_s:.0f} s (key {key!r}). Every process of the job must"
      " lower the same programs in the same order, and after a failure"
      " every process must lower again (jax.clear_caches(), then call):"
      " a process that lowers again alone waits here, and lowering"
      " again pairs it with the others once they do."
      f" ({cause})")


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
  lib.FiccoWindowExported.argtypes = [ctypes.c_int, i64, ctypes.c_int]
  lib.FiccoWindowExported.restype = None
  lib.FiccoWindowEpoch.argtypes = [ctypes.c_int, i64, ctypes.c_int]
  lib.FiccoWindowEpoch.restype = i64
  lib.FiccoWindowPoisoned.argtypes = [ctypes.c_int, i64, ctypes.c_int]
  lib.FiccoWindowCount.argtypes = [ctypes.c_int]
  lib.FiccoWindowCount.restype = i64
  lib.FiccoWindowPending.argtypes = [ctypes.c_int]
  lib.FiccoWindowPending.restype = i64
  lib.FiccoWindowIssueWaits.argtypes = [ctypes.c_int]
  lib.FiccoWindowIssueWaits.restype = i64
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


def _group_key(platform: int, ids) -> str:
  """A group's part of its store keys: the platform (each counts its
  families apart) and the group's device ids, in rank order."""
  return f"{platform}/" + "-".join(str(i) for i in ids)


def _retire(fam: Family, platform: int, why: str) -> None:
  """Takes a family that lowering replaced out of use: its windows here are
  poisoned (a program still compiled against it fails, saying to lower
  again) and freed by a later `_new_family` once no call holds them."""
  _lib().FiccoWindowRetire(platform, fam.id, why.encode())


def _new_family(groups, sig, axis_name: str, slot_bytes: int,
                platform: int, kind: str) -> Family:
  """Creates (and exchanges) a family; the caller holds `_lock`.

  ``kind`` says what the family is for ("start 0 of program 'jit_f'", "the
  push pool"): every rank must make one of the same kind and slot.
  """
  # Lowering is where families come and go: free the retired ones whose
  # calls have all ended first, so a loop that recovers from failures by
  # lowering again holds at most the families of its last failure.
  _lib().FiccoWindowReap(platform)
  _check_one_host(groups, axis_name, EXCHANGE_TIMEOUT_S)
  # One more than the group's exchanges completed (here, or by a peer that
  # saw every rank agree after this process gave up): a failed one is
  # retried at the same generation, so a process that lowered again alone
  # still pairs.
  gens = []
  for g in sig:
    done = _generations.get((platform, g), 0)
    while _directory.peek(
        f"ficco/done/{_group_key(platform, g)}/{done + 1}") is not None:
      done += 1
    gens.append(done + 1)
  gens = tuple(gens)
  fam = Family(id=_next_id[0], slot_bytes=slot_bytes, generations=gens)
  _next_id[0] += 1
  try:
    _create_and_map(fam, groups, platform, kind)
  except BaseException:
    # The windows made so far go (and their shared-memory names with them).
    _retire(fam, platform, "its windows could not all be made")
    _lib().FiccoWindowReap(platform)
    raise
  for g, gen in zip(sig, gens):
    _generations[(platform, g)] = gen
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
      fam = _new_family(groups, sig, axis_name, slot_bytes, platform,
                        f"start {len(sites)} of program {name!r}")
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
      made = _new_family(groups, sig, axis_name, grown, platform,
                         f"family {key[2]} of the push pool")
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


def _live_window(value: str, who: str, kind: str, slot_bytes: int,
                 nonce: str, refused: list[str]) -> bool:
  """Whether a peer's published window ``value`` is live (not withdrawn by
  a failed attempt). One of another kind or slot is an error, live or
  withdrawn because it refused this attempt's window (``nonce``) for that;
  the nonces of the live ones go to ``refused``."""
  info = json.loads(value)
  if (info.get("kind"), info.get("slot")) != (kind, slot_bytes) and (
      "handle" in info or nonce in info.get("refused", ())):
    if "handle" in info:
      refused.append(info["nonce"])
    # Mapping it would let copies run past the smaller slot.
    raise ValueError(
        f"ficco window exchange: {who} made a window for {info.get('kind')}"
        f" with a slot of {info.get('slot')} bytes where this process makes"
        f" one for {kind} with {slot_bytes} bytes. Every process must lower"
        " the same programs, with the same shapes, in the same order.")
  # Withdrawn (no handle): its process may make another attempt.
  return "handle" in info


def _who(q: int, peer) -> str:
  return f"rank {q} (device {peer.id}, process {peer.process_index})"


def _create_and_map(fam: Family, groups, platform: int, kind: str) -> None:
  lib, here = _lib(), jax.process_index()
  gen = {id(g): fam.generations[i] for i, g in enumerate(groups)}
  tag = lambda g: (_group_key(platform, [d.id for d in g])
                   + f"/{gen[id(g)]}")
  mine = [(g, r, d) for g in groups for r, d in enumerate(g)
          if d.process_index == here]
  # This attempt's windows, told apart from another attempt's at the same
  # generation (one that failed, or a peer's retry).
  nonce = secrets.token_hex(8)
  published = []
  # Per group, the nonce of each rank's window that this process maps (its
  # own at its ranks), in rank order: every rank must map the same ones.
  mapped = {id(g): [None] * len(g) for g, _, _ in mine}

  def map_peer(g, q, info):
    """Maps rank ``q``'s window ``info`` on this process's ranks of ``g``
    (again, if it made another attempt: the old mapping is released with
    the family). A remote window that its process withdrew (and freed)
    meanwhile is left for its next attempt (step 4)."""
    mapped[id(g)][q] = None
    raw = bytes.fromhex(info["handle"])
    same = info["process"] == here
    for g2, r, d in mine:
      if g2 is g and r != q:
        try:
          _call(lib.FiccoWindowMap, platform, fam.id,
                handler_ordinal(d, platform), q,
                info["local"] if same else -1, raw, len(raw))
        except RuntimeError as e:
          now = None if same else _directory.peek(
              f"ficco/window/{tag(g)}/{q}")
          if now is not None and json.loads(now).get("nonce") != info[
              "nonce"]:
            return  # Withdrawn or replaced: not this attempt's to map.
          raise RuntimeError(
              f"{e}. The window of {_who(q, g[q])} could not be mapped; if"
              " its process completed this exchange without this one (or"
              " freed it), lower again in every process (jax.clear_caches(),"
              " then call).") from e
    mapped[id(g)][q] = info["nonce"]

  def publish_mapped(g):
    for g2, r, _ in mine:
      if g2 is g:
        key = f"ficco/mapped/{tag(g)}/{r}"
        _directory.set(key, json.dumps(mapped[id(g)]))
        if key not in published:
          published.append(key)

  by_group = list({id(g): g for g, _, _ in mine}.values())

  def _behind():
    """The remote ranks whose word differs from what this process mapped."""
    return [(g, q, peer) for g in by_group for q, peer in enumerate(g)
            if peer.process_index != here and _directory.peek(
                f"ficco/mapped/{tag(g)}/{q}") != json.dumps(mapped[id(g)])]

  own = {}  # (group, rank) -> this process's published window
  refused = []  # Peers' windows of another kind or slot, by nonce.
  try:
    # 1. Create and publish this process's windows.
    for g, r, d in mine:
      ids = (ctypes.c_int64 * len(g))(*[d2.id for d2 in g])
      handle = ctypes.create_string_buffer(_HANDLE_BYTES)
      n = ctypes.c_int64(_HANDLE_BYTES)
      _call(lib.FiccoWindowCreate, platform, fam.id,
            handler_ordinal(d, platform), r, len(g), ids, fam.slot_bytes,
            handle, ctypes.byref(n))
      key = f"ficco/window/{tag(g)}/{r}"
      own[(id(g), r)] = {
          "process": here, "local": handler_ordinal(d, platform),
          "handle": handle.raw[:n.value].hex(), "nonce": nonce,
          "kind": kind, "slot": fam.slot_bytes}
      if any(peer.process_index != here for peer in g):
        # A peer process may map it from now on, whatever happens here.
        lib.FiccoWindowExported(platform, fam.id, handler_ordinal(d, platform))
      _directory.set(key, json.dumps(own[(id(g), r)]))
      published.append(key)
    # 2. Map every peer's window: this process's by pointer, the others'
    # once published and live.
    for g in by_group:
      for q, peer in enumerate(g):
        if peer.process_index == here:
          map_peer(g, q, own[(id(g), q)])
        else:
          who = _who(q, peer)
          map_peer(g, q, json.loads(_directory.get(
              f"ficco/window/{tag(g)}/{q}", EXCHANGE_TIMEOUT_S,
              f"the window of {who}",
              functools.partial(_live_window, who=who, kind=kind,
                                slot_bytes=fam.slot_bytes, nonce=nonce,
                                refused=refused))))
    # 3. Publish which windows this process mapped, and 4. wait until every
    # rank of each group has mapped the same ones. A peer whose window
    # changed meanwhile (its attempt failed and it made another) is mapped
    # again; this process's own windows stay, so the ranks converge.
    for g in by_group:
      publish_mapped(g)
    deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
    while True:
      behind, changed = _behind(), False
      for g, q, peer in behind:
        value = _directory.peek(f"ficco/window/{tag(g)}/{q}")
        if value is None or not _live_window(
            value, _who(q, peer), kind, fam.slot_bytes, nonce, refused):
          continue
        info = json.loads(value)
        if info["nonce"] != mapped[id(g)][q]:
          map_peer(g, q, info)
          publish_mapped(g)
          changed = True
      if not behind:
        break
      if changed:
        continue  # Look again before the deadline: they may agree now.
      if time.monotonic() > deadline:
        # A peer completes once it sees this process's word agree: take
        # the words back first, then look once more, so that this process
        # fails only where no peer can have completed with it.
        for g, r, _ in mine:
          _directory.set(f"ficco/mapped/{tag(g)}/{r}", "[]")
        if not _behind():
          for g in by_group:
            publish_mapped(g)
          break
        g, q, peer = behind[0]
        raise _late(f"the word that {_who(q, peer)} mapped this attempt's"
                   " windows", f"ficco/mapped/{tag(g)}/{q}",
                   EXCHANGE_TIMEOUT_S, "its windows were not those mapped"
                   " here, or it never published")
      time.sleep(0.02)
  except BaseException:
    # Withdrawn, so that a peer that comes late waits for this process's
    # next attempt instead of mapping windows about to be freed; the peers
    # whose windows this attempt refused learn why from it.
    for key in published:
      gone = ({"kind": kind, "slot": fam.slot_bytes, "refused": refused}
              if key.startswith("ficco/window/") else [])
      try:
        _directory.set(key, json.dumps(gone))
      except Exception:  # pylint: disable=broad-exception-caught
        pass  # The nonces still refuse a stale window.
    raise
  for g in by_group:
    # The group's generation is spent: a peer whose own exchange failed
    # after this one saw every rank agree moves past it too (`_new_family`).
    _directory.set(f"ficco/done/{tag(g)}", "1")
  for g, r, d in mine:
    lib.FiccoWindowSealed(platform, fam.id, handler_ordinal(d, platform))


def epoch(family: int, device_ordinal: int, platform: int) -> int:
  """Starts so far on a device's window of ``family`` (-1: no window)."""
  return _lib().FiccoWindowEpoch(platform, family, device_ordinal)


def window_count(platform: int) -> int:
  """Windows whose memory this process holds: in use, retired after a
  failure and not yet freed, or freed but for CUDA device memory that a
  process of another rank maps (docs/windows.md, "Failure and timeouts")."""
  return _lib().FiccoWindowCount(platform)


def issue_waits(platform: int) -> int:
  """How often a window or push handler waited for another thread's handler
  of its window on its device: nonzero usually means programs that share
  windows were dispatched from several threads (docs/protocol.md, "Several
  dispatching threads")."""
  return _lib().FiccoWindowIssueWaits(platform)


def pending_entries(platform: int) -> int:
  """wait/done entries of window invocations not yet taken (0 when idle)."""
  return _lib().FiccoWindowPending(platform)
