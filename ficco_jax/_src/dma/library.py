"""Loads libficco_ffi and registers its handlers as XLA FFI targets.

The library is built by ``pip install .`` (scikit-build-core) into this
package's directory. Loading and registration happen once, on first use, so
importing ficco_jax never requires the native library.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import pathlib
import threading

import jax

_LIBRARY_NAME = "libficco_ffi.so"
_CPU, _CUDA = 0, 1  # FiccoPlatform in xla_ffi/ficco_ffi.h

# target name -> handler symbol stem; the platform suffix picks the backend.
TARGETS: dict[str, str] = {
    "ficco_peer_copy_start": "FiccoPeerCopyStart",
    "ficco_peer_copy_sync": "FiccoPeerCopySync",
    "ficco_flags_arm": "FiccoFlagsArm",
    "ficco_window_start": "FiccoWindowStart",
    "ficco_window_wait": "FiccoWindowWait",
    "ficco_window_done": "FiccoWindowDone",
    "ficco_push_arm": "FiccoPushArm",
    "ficco_push_start": "FiccoPushStart",
    "ficco_push_finish": "FiccoPushFinish",
    "ficco_push_gather": "FiccoPushGather",
    # Test hooks (dma/late_landing.py).
    "ficco_test_late_landing": "FiccoTestLateLanding",
    "ficco_test_late_landing_join": "FiccoTestLateLandingJoin",
}

# CPU targets with an instantiate stage: it names the start instruction
# (xla_ffi/start_instance.h), by which the CPU twin pairs, or checks, the
# devices' calls when one site runs twice in an execution.
_INSTANTIATED_ON_CPU = frozenset({
    "ficco_peer_copy_start", "ficco_window_start", "ficco_push_start",
    "ficco_push_gather"})

_lock = threading.Lock()
_registered = False


def _installed_library() -> pathlib.Path | None:
  """The compiled library of an installed ficco-jax distribution, if any
  (it may be shadowed by a source tree earlier on sys.path)."""
  try:
    files = importlib.metadata.distribution("ficco-jax").files or ()
  except importlib.metadata.PackageNotFoundError:
    return None
  for f in files:
    if f.name == _LIBRARY_NAME:
      located = pathlib.Path(f.locate())
      if located.exists():
        return located
  return None


def _missing_library_message(path: pathlib.Path) -> str:
  package = path.parents[2]  # .../ficco_jax/_src/dma/<lib> -> ficco_jax
  installed = _installed_library()
  if (package.parent / "pyproject.toml").exists() and (
      installed is not None and installed != path):
    # The usual cause: `PYTHONPATH=.` or running from the repository root
    # puts the source tree, which is never compiled in place, first.
    return (
        f"ficco_jax was imported from its source tree ({package}), which"
        f" has no compiled library; the installed copy's is {installed}."
        " Run from outside the repository and without PYTHONPATH pointing"
        " at it, so that `import ficco_jax` finds the installed package.")
  return (f"ficco's native library {path} is missing: comm='dma' needs the"
          " compiled XLA FFI handlers. Install ficco_jax from its source"
          " tree with `pip install .` (or use Schedule(comm='xla')).")


@functools.cache
def _library() -> ctypes.CDLL:
  path = pathlib.Path(__file__).parent / _LIBRARY_NAME
  if not path.exists():
    raise ImportError(_missing_library_message(path))
  lib = ctypes.CDLL(str(path))
  lib.FiccoCudaCompiled.restype = ctypes.c_int
  lib.FiccoLiveInvocations.restype = ctypes.c_int64
  lib.FiccoLiveInvocations.argtypes = [ctypes.c_int]
  lib.FiccoPendingEntries.restype = ctypes.c_int64
  lib.FiccoPendingEntries.argtypes = [ctypes.c_int]
  lib.FiccoEventCounts.restype = ctypes.c_int
  lib.FiccoEventCounts.argtypes = [
      ctypes.c_int, ctypes.c_int,
      ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
  lib.FiccoHostStats.restype = ctypes.c_int
  lib.FiccoHostStats.argtypes = [
      ctypes.c_int, ctypes.c_int,
      ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
  lib.FiccoHostStatsReset.restype = None
  lib.FiccoHostStatsReset.argtypes = [ctypes.c_int]
  lib.FiccoSetIssueMode.restype = ctypes.c_int
  lib.FiccoSetIssueMode.argtypes = [ctypes.c_int, ctypes.c_int]
  lib.FiccoIssueMode.restype = ctypes.c_int
  lib.FiccoIssueMode.argtypes = [ctypes.c_int]
  lib.FiccoTraceCompiled.restype = ctypes.c_int
  lib.FiccoTraceCompiled.argtypes = []
  lib.FiccoTraceEnable.restype = ctypes.c_int
  lib.FiccoTraceEnable.argtypes = [ctypes.c_int64]
  lib.FiccoTraceDisable.restype = None
  lib.FiccoTraceRead.restype = ctypes.c_int64
  lib.FiccoTraceRead.argtypes = [ctypes.POINTER(ctypes.c_int64),
                                 ctypes.c_int64,
                                 ctypes.POINTER(ctypes.c_int64)]
  lib.FiccoTraceGpuEnable.restype = ctypes.c_int
  lib.FiccoTraceGpuEnable.argtypes = [ctypes.c_int64]
  lib.FiccoTraceGpuTimes.restype = ctypes.c_int64
  lib.FiccoTraceGpuTimes.argtypes = [ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_int64),
                                     ctypes.c_int64]
  lib.FiccoTraceMark.restype = None
  lib.FiccoTraceMark.argtypes = [ctypes.c_int, ctypes.c_int64]
  lib.FiccoTestSetNeverArrive.argtypes = [ctypes.c_int]
  lib.FiccoTestSetNeverArrive.restype = None
  lib.FiccoTestSetFault.argtypes = [ctypes.c_int, ctypes.c_int]
  lib.FiccoTestSetFault.restype = None
  lib.FiccoTestClearFaults.restype = None
  lib.FiccoStartInstanceTypeId.restype = ctypes.c_void_p
  lib.FiccoStartInstanceTypeInfo.restype = ctypes.c_void_p
  return lib


def load() -> ctypes.CDLL:
  """The loaded library (ImportError, with the fix, if it is missing)."""
  return _library()


def library_path() -> pathlib.Path:
  return pathlib.Path(_library()._name)


def cuda_compiled() -> bool:
  """Whether the CUDA handlers were compiled into the library (False when
  the library itself is missing)."""
  try:
    return bool(_library().FiccoCudaCompiled())
  except ImportError:
    return False


def _has_cuda_backend() -> bool:
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


def ensure_registered() -> None:
  """Registers the FFI targets: "cpu" always, "CUDA" when compiled in and
  jax has a CUDA backend. Idempotent; called by the lowering rules."""
  global _registered
  with _lock:
    if _registered:
      return
    lib = _library()  # Raises ImportError with the fix if it is missing.
    platforms = [("cpu", "Cpu")]
    if cuda_compiled() and _has_cuda_backend():
      platforms.append(("CUDA", "Cuda"))
    # Before the handlers whose state it types.
    jax.ffi.register_ffi_type(
        "ficco_start_instance",
        {"type_id": jax.ffi.pycapsule(lib.FiccoStartInstanceTypeId()),
         "type_info": jax.ffi.pycapsule(lib.FiccoStartInstanceTypeInfo())},
        platform="cpu")
    instantiate = jax.ffi.pycapsule(lib.FiccoStartInstantiateCpu)
    for platform, suffix in platforms:
      for target, stem in TARGETS.items():
        handler = jax.ffi.pycapsule(getattr(lib, stem + suffix))
        if platform == "cpu" and target in _INSTANTIATED_ON_CPU:
          handler = {"instantiate": instantiate, "execute": handler}
        jax.ffi.register_ffi_target(target, handler, platform=platform)
    _registered = True


def platform_id(platform: str) -> int:
  if platform == "cpu":
    return _CPU
  if platform in ("cuda", "gpu"):
    return _CUDA
  raise ValueError(f"{platform=} must be 'cpu' or 'cuda'.")


def live_invocations(platform: str = "cpu") -> int:
  """Invocations not yet released by every rank's done (0 when idle)."""
  n = _library().FiccoLiveInvocations(platform_id(platform))
  if n < 0:
    raise RuntimeError(f"{platform} handlers are not compiled in.")
  return n


def pending_entries(platform: str = "cpu") -> int:
  """Rendezvous, wait and done entries still registered, and on CPU the
  waits' deadline timers not yet cancelled (0 when idle)."""
  n = _library().FiccoPendingEntries(platform_id(platform))
  if n < 0:
    raise RuntimeError(f"{platform} handlers are not compiled in.")
  return n


def event_counts(device_ordinal: int, platform: str = "cpu") -> tuple[int, int]:
  """``(created, pooled)`` events of one device: created grows only when the
  pool runs dry, so steady-state calls leave it unchanged."""
  created, pooled = ctypes.c_int64(), ctypes.c_int64()
  if _library().FiccoEventCounts(platform_id(platform), device_ordinal,
                                 ctypes.byref(created), ctypes.byref(pooled)):
    raise RuntimeError(f"{platform} handlers are not compiled in.")
  return created.value, pooled.value


# Sections of FiccoHostStats, in its order (xla_ffi/ficco_ffi.h).
HOST_STATS = ("start", "start_rendezvous", "start_issue", "sync",
              "sync_waits")


def host_stats(platform: str = "cpu") -> dict[str, tuple[int, float]]:
  """Host time in the peer-copy handlers since the last reset.

  Returns:
    ``{section: (calls, seconds)}`` summed over devices, for the sections of
    `HOST_STATS`: whole starts, their wait for peers and their copy issue,
    whole syncs, and the compute-stream waits those enqueue (``calls``
    counts the waits). Measured by the handlers themselves, so without a
    profiler's overhead.
  """
  lib = _library()
  out = {}
  for i, name in enumerate(HOST_STATS):
    calls, ns = ctypes.c_int64(), ctypes.c_int64()
    if lib.FiccoHostStats(platform_id(platform), i, ctypes.byref(calls),
                          ctypes.byref(ns)):
      raise RuntimeError(f"{platform} handlers are not compiled in.")
    out[name] = (calls.value, ns.value * 1e-9)
  return out


def reset_host_stats(platform: str = "cpu") -> None:
  _library().FiccoHostStatsReset(platform_id(platform))


# Points of the host timeline, in the order of TracePoint (host_trace.h).
TRACE_POINTS = ("start_enter", "start_exit", "issue_begin", "peers_arrived",
                "issue_end", "sync_enter", "sync_issued", "sync_exit",
                "mark", "gpu_start", "gpu_sync_in", "gpu_sync_out",
                "gpu_copy_begin", "gpu_copy_end")


def trace_compiled() -> bool:
  """Whether the library was built with its diagnostic timeline (the
  ``FICCO_TRACE`` build option; docs/debugging.md)."""
  return bool(_library().FiccoTraceCompiled())


def trace_enable(capacity: int) -> None:
  """Starts a host timeline of the rendezvous transport's handlers (both
  platforms), dropping the previous one; call it only while no op is in
  flight.

  Args:
    capacity: events kept; later ones are counted and dropped.

  Raises:
    RuntimeError: the library was built without the timeline.
  """
  if capacity < 0:
    raise ValueError(f"capacity={capacity} must be >= 0.")
  rc = _library().FiccoTraceEnable(capacity)
  if rc == -2:
    raise RuntimeError(
        "libficco_ffi was built without its diagnostic timeline; reinstall"
        " with `pip install . -Ccmake.define.FICCO_TRACE=ON`"
        " (docs/debugging.md).")
  if rc:
    raise MemoryError(f"cannot allocate a trace of {capacity} events.")


def trace_disable() -> None:
  """Stops recording, GPU stamps included (the events stay readable)."""
  _library().FiccoTraceDisable()


def trace_gpu_enable(per_device: int) -> None:
  """Adds GPU stamps to the timeline (CUDA): events ``gpu_*`` whose tag
  indexes `trace_gpu_times`. Call after `trace_enable`, while no op is in
  flight; each stamp costs the host a ``cudaEventRecord``.

  Args:
    per_device: stamps kept per device (timing events made once).
  """
  if per_device < 1:
    raise ValueError(f"per_device={per_device} must be >= 1.")
  if _library().FiccoTraceGpuEnable(per_device):
    raise RuntimeError("GPU stamps need the CUDA handlers and a working"
                       " CUDA runtime.")


def trace_gpu_times(device: int, max_stamps: int) -> list[int]:
  """GPU times (ns) of ``device``'s stamps, relative to its first; blocks
  until they ran. Read after the traced ops finished."""
  if max_stamps < 0:
    raise ValueError(f"max_stamps={max_stamps} must be >= 0.")
  buf = (ctypes.c_int64 * max(max_stamps, 1))()
  n = _library().FiccoTraceGpuTimes(device, buf, max_stamps)
  if n < 0:
    raise RuntimeError("reading the GPU stamps failed (no CUDA handlers, or"
                       " a CUDA error).")
  return list(buf[:n])


def trace_mark(device: int, tag: int) -> None:
  """Records a ``"mark"`` event from the calling thread (e.g. a dispatch)."""
  _library().FiccoTraceMark(device, tag)


def trace_read(max_events: int) -> tuple[list[dict], int]:
  """The timeline's events; read it after the traced ops finished.

  Args:
    max_events: at most this many events are returned.

  Returns:
    ``(events, recorded)``: events in the order they claimed their slot, as
    dicts with ``t_ns`` (steady clock), ``device``, ``point`` (a name of
    `TRACE_POINTS`), ``cpu`` (the CPU the recording thread ran on) and
    ``tag`` (the start's call site, else -1 or the mark's tag); and how many
    were recorded, which exceeds the capacity if the trace overflowed.
  """
  buf = (ctypes.c_int64 * (4 * max(max_events, 1)))()
  recorded = ctypes.c_int64()
  copied = _library().FiccoTraceRead(buf, max_events, ctypes.byref(recorded))
  events = []
  for i in range(copied):
    t, device, packed, tag = buf[4 * i:4 * i + 4]
    cpu, point = divmod(packed, 65536)  # point + cpu * 65536; cpu may be -1
    events.append(dict(t_ns=t, device=device,
                       point=(TRACE_POINTS[point] if point < len(TRACE_POINTS)
                              else "?"),
                       cpu=cpu, tag=tag))
  return events, recorded.value


# Values of FiccoSetIssueMode (xla_ffi/issuer.h), by name.
ISSUE_MODES = ("last", "parallel", "async")


def issue_mode(platform: str = "cpu") -> str:
  """Who issues the copies of a start on ``platform`` (`set_issue_mode`)."""
  mode = _library().FiccoIssueMode(platform_id(platform))
  if mode < 0:
    raise RuntimeError(f"{platform} handlers are not compiled in.")
  return ISSUE_MODES[mode]


def set_issue_mode(mode: str, platform: str = "cpu") -> str:
  """Selects who issues the copies of later starts; call it only while no
  op is in flight (block on every result first).

  Args:
    mode: ``"parallel"`` (each rank in its start, after a host
      rendezvous; CUDA only), ``"async"`` (each device's own issuer thread
      waits for the peers and issues; start returns at once and sync waits
      for the issue) or ``"last"`` (the last rank to arrive issues for all:
      the CPU twin's default). CUDA starts in ``"async"``. A debug hook
      (docs/debugging.md): the mode changes nothing a program computes.
    platform: ``"cpu"`` or ``"cuda"``.

  Returns:
    The previous mode.
  """
  if mode not in ISSUE_MODES:
    raise ValueError(f"mode={mode!r} must be one of {ISSUE_MODES}.")
  previous = _library().FiccoSetIssueMode(platform_id(platform),
                                          ISSUE_MODES.index(mode))
  if previous < 0:
    raise ValueError(
        f"mode={mode!r} is not supported on {platform!r} (the CPU twin takes"
        " 'last' or 'async'), or its handlers are not compiled in.")
  return ISSUE_MODES[previous]


def set_never_arrive(device_ordinal: int) -> None:
  """Test hook: every start on this device fails at once without joining its
  peers, which then fail by timeout."""
  _library().FiccoTestSetNeverArrive(device_ordinal)


# Protocol steps of the fault hook, per transport: "start" is the
# rendezvous and window start and the push arm; "wait" the rendezvous sync
# that waits for landing buffers, the window wait and the push start;
# "done" the rendezvous sync that ends invocations, the window done and the
# push finish; "held": the window and push handlers that take a window's
# issue lock find it held by another thread past the op's timeout.
FAULT_STEPS = ("start", "wait", "done", "held")


def set_fault(device_ordinal: int, step: str) -> None:
  """Test hook: the handlers of protocol ``step`` (`FAULT_STEPS`) on this
  device fail at once, as a rank that raises there would ("held": as if
  another thread held the window past the op's timeout). The rendezvous
  transport's waits and dones are one handler, sync: a sync that does both
  fails under either step."""
  if step not in FAULT_STEPS:
    raise ValueError(f"step={step!r} must be one of {FAULT_STEPS}.")
  _library().FiccoTestSetFault(device_ordinal, FAULT_STEPS.index(step) + 1)


def clear_faults() -> None:
  """Turns the never-arrive and fault hooks off."""
  _library().FiccoTestClearFaults()
