"""SM clocks, power and clock-limit reasons of the GPUs while a block runs.

A step that runs longer when timed than when traced, or one GPU whose every
kernel is slower than its peer's, is often a clock limit (power cap,
thermal), not the program. `Monitor` samples ``nvidia-smi`` every
``period_ms`` in a subprocess while its block runs and summarises each GPU:
mean and lowest SM clock, mean and highest power draw, highest temperature,
and the clock-limit reasons seen. Without ``nvidia-smi`` (CPU hosts) it
records nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

FIELDS = ("index", "clocks.sm", "power.draw", "temperature.gpu")
# nvidia-smi's name for the active clock-limit reasons; drivers before 535
# call it clocks_throttle_reasons.active.
REASON_FIELDS = ("clocks_event_reasons.active",
                 "clocks_throttle_reasons.active")
# Bits of the reasons mask (nvml's nvmlClocksEventReason*).
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap",
           0x8: "HW slowdown", 0x10: "sync boost", 0x20: "SW thermal",
           0x40: "HW thermal", 0x80: "HW power brake",
           0x100: "display clocks"}


def decode(mask: int) -> list[str]:
  """The reasons a clock-limit bitmask names."""
  return [name for bit, name in REASONS.items() if mask & bit]


def _number(text: str) -> float | None:
  """A sampled value, or None for "[N/A]", "[Not Supported]" and the like
  (some boards do not report power, or the reasons)."""
  try:
    return float(int(text, 16)) if text.startswith("0x") else float(text)
  except ValueError:
    return None


def parse(lines: list[str]) -> dict[str, dict]:
  """Per GPU index, the summary of ``index, sm MHz, W, C, reasons`` lines;
  a value a GPU does not report is left out of its summary (None)."""
  per: dict[str, list[tuple]] = {}
  for line in lines:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS) + 1 or not parts[0].isdigit():
      continue  # A header, an error line or a partial line.
    values = tuple(_number(p) for p in parts[1:])
    if values[0] is None:
      continue  # No SM clock: nothing to say of this sample.
    per.setdefault(parts[0], []).append(values)
  out = {}
  for idx, rows in sorted(per.items()):
    sms, watts, temps, masks = (
        [r[i] for r in rows if r[i] is not None] for i in range(4))
    out[idx] = {"samples": len(rows),
                "sm_mhz_mean": sum(sms) / len(sms), "sm_mhz_min": min(sms),
                "power_w_mean": sum(watts) / len(watts) if watts else None,
                "power_w_max": max(watts) if watts else None,
                "temp_c_max": max(temps) if temps else None,
                "limits": sorted({r for m in masks for r in decode(int(m))}
                                 - {"idle"})}
  return out


_field: list[str | None] = []  # The probe's answer, once per process.


def _reason_field() -> str | None:
  """The reasons field this driver's nvidia-smi knows (None: neither, or
  the probe hung)."""
  if not _field:
    found = None
    for field in REASON_FIELDS:
      # An unknown field makes nvidia-smi exit at once: try the old name.
      try:
        probe = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, check=False, timeout=15)
      except subprocess.TimeoutExpired:
        break  # A hung driver query: no samples rather than a stall.
      if probe.returncode == 0:
        found = field
        break
    _field.append(found)
  return _field[0]


class Monitor:
  """``with Monitor() as m: ...``; then ``m.summary`` (None without
  nvidia-smi, or when it failed)."""

  def __init__(self, period_ms: int = 200):
    self.period_ms = period_ms
    self.summary: dict[str, dict] | None = None
    self._lines: list[str] = []
    self._proc = None
    self._reader = None

  def _start(self, reason_field: str, ids: list[str]):
    cmd = ["nvidia-smi",
           f"--query-gpu={','.join(FIELDS + (reason_field,))}",
           "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"]
    return subprocess.Popen(cmd + ids, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)

  def __enter__(self):
    if shutil.which("nvidia-smi") is None:
      return self
    # nvidia-smi ignores CUDA_VISIBLE_DEVICES: sample only the GPUs this
    # process sees (their indices or UUIDs), not idle ones beside them.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [f"--id={visible}"] if visible else []
    field = _reason_field()
    if field is not None:
      self._proc = self._start(field, ids)
    if self._proc is not None:
      self._reader = threading.Thread(target=self._read, daemon=True)
      self._reader.start()
    return self

  def _read(self):
    for line in self._proc.stdout:
      self._lines.append(line)

  def __exit__(self, *exc):
    if self._proc is None:
      return False
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    self._reader.join(timeout=5)
    self._proc.stdout.close()
    self.summary = parse(self._lines) or None
    return False


def describe(summary: dict[str, dict] | None) -> str:
  """One line over the GPUs: SM MHz mean (lowest sample), W mean (highest),
  and the limits seen."""
  if not summary:
    return "n/a"
  sm = [s["sm_mhz_mean"] for s in summary.values()]
  lo = min(s["sm_mhz_min"] for s in summary.values())
  w = [s["power_w_mean"] for s in summary.values()
       if s["power_w_mean"] is not None]
  hi = max((s["power_w_max"] for s in summary.values()
            if s["power_w_max"] is not None), default=None)
  limits = sorted({r for s in summary.values() for r in s["limits"]})
  return (f"{min(sm):.0f}-{max(sm):.0f} MHz (low {lo:.0f})"
          + (f", {min(w):.0f}-{max(w):.0f} W (high {hi:.0f})" if w else "")
          + (f", limits: {', '.join(limits)}" if limits else ""))


def describe_cases(summaries: list[dict[str, dict] | None]) -> str | None:
  """One line over several timed blocks (the ops suite's cases): the range
  of their mean SM clocks (each block's slowest GPU) and every limit seen;
  None when no block was sampled."""
  seen = [s for s in summaries if s]
  if not seen:
    return None
  sm = [min(g["sm_mhz_mean"] for g in s.values()) for s in seen]
  limits = sorted({r for s in seen for g in s.values() for r in g["limits"]})
  return (f"{len(seen)} timed blocks: mean SM clock {min(sm):.0f}-"
          f"{max(sm):.0f} MHz (the slowest GPU of each)"
          + (f", limits: {', '.join(limits)}" if limits else ", no limits"))
