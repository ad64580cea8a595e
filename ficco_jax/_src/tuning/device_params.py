"""Per-device-kind constants of the cost model, and where they come from.

Every number a prediction uses lives in one frozen `DeviceParams`, looked up
by ``jax.Device.device_kind``. The built-in H200 values are measured on a
4xH200 NVSwitch host and fitted to its characterisation and benchmark data
(see ``_H200``; the data is in the repository's ``benchmarks/data/``). A
fitted file in the package data,
``ficco_jax/data/cost_model/<device_kind_slug>.json`` (written by the
benchmark command's ``characterize`` and ``heuristic`` suites), overrides
the built-ins field by field when it exists; a caller overrides further
with `params_for(..., overrides=...)`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from typing import Any, Mapping

DATA_DIR = pathlib.Path(__file__).resolve().parents[2] / "data"


def _covers(pairs, op: str, axis_size: int) -> bool:
  """Whether ``(op, axis_sizes)`` pairs name ``op`` at ``axis_size``
  (``()``: every size)."""
  return any(o == op and (not sizes or axis_size in sizes)
             for o, sizes in pairs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceParams:
  """What the cost model knows about one kind of device and its interconnect.

  Bandwidths are bytes/s, times seconds.

  Attributes:
    name: the device kind these numbers describe.
    matmul_flops: dense 16-bit matmul throughput of a large, square problem.
    matmul_eff: fraction of ``matmul_flops`` an XLA dot of a large
      tensor-parallel shape reaches (the tail of the efficiency curve).
    rows_half: rows (and columns) at which a dot runs at half of its
      large-shape efficiency; sets the default decomposition-loss curve
      ``eff(r) = r / (r + rows_half)`` (used without ``decomposition``).
    decomposition: measured ``(output tiles, relative efficiency)`` points,
      tiles being ``rows * n / 128**2`` of a dot ``[rows, k] @ [k, n]``
      (efficiency relative to a large dot, <= 1, non-decreasing); they
      replace the ``rows_half`` curve. Empty: use ``rows_half``.
    decomposition_scale: the table's loss ``1 - eff`` is multiplied by
      this. The table times dots alone; inside a schedule XLA picks its own
      kernels for the pieces, and the loss there, fitted from the schedule
      benchmarks, is a fraction of it (1: the table as measured).
    launch_s: fixed cost of one dot of a piece (kernel launch, the
      update-slice that places it).
    hbm_bw: local memory bandwidth (read + write), the roofline's other arm.
    receive_bw: per-device receive bandwidth of copy-engine traffic when
      every device of the axis receives from ``k`` peers at once, indexed
      ``k - 1``. Longer axes reuse the last entry.
    ce_latency_s: per copy-engine transfer (issue + completion event).
    dma_op_s: device time of each copy-engine op (start / wait / done of
      the peer-copy protocol: cross-device event waits), on top of its copies.
    host_op_s: host time of each copy-engine op (the device threads'
      rendezvous in start and done); see `host_call_s`.
    host_call_s: host time to dispatch one op as its own program. An op
      takes at least ``host_call_s + host_op_s * (copy-engine ops)``: the
      device cannot run what the host has not issued yet.
    collective_bw: per-device receive bandwidth of XLA's (NCCL) all-gather /
      reduce-scatter, what ``dataflow="none"`` uses.
    collective_latency_s: fixed cost of one such collective.
    p2p_bw: bandwidth of one XLA collective-permute (comm='xla' pieces).
    p2p_latency_s: fixed cost of one collective-permute.
    contention: ``{comm: (alpha, beta)}``: while that engine's transfers
      are in flight a matmul runs ``1 + alpha`` times slower, and while a
      matmul runs transfers run ``1 + beta`` times slower.
    calibration: per schedule family ``(op, dataflow, num_chunks, comm,
      a, b)``: the model's total ``t`` becomes ``t * exp(a + b * ln(t /
      1 ms))``. Fitted on the fit split of the schedule benchmarks
      (the ``heuristic`` benchmark suite): what the component model misses for
      that family (host-bound issue on short ops, copy queues that share
      links) as a smooth function of the op's size. Families without an
      entry are not corrected.
    calibrated_axis_size: the axis size the calibration was fitted at; at
      other sizes it does not apply (0: at every size).
    pallas_pieces: ``(op, axis_sizes)`` pairs: the ops whose copy-engine
      schedules run their pieces on ficco's Pallas kernel by default where
      its tiles divide them (full depth steps), because it measured faster
      than XLA's dot there, over these axis sizes (``()``: every size).
    push_gather_at: axis sizes (one process) where the all-gather's
      single-chunk copy-engine schedules (direct or ring) run as the push
      all-gather (``compute_granularity="flagged"``) by default, because it
      measured faster there than the pulled gathers (``()``: none).
    checked_at: ``(op, axis_sizes)`` pairs (``()``: every size) where no
      calibration applies but the component model's picks were checked
      against measurements and held: there overlap needs only the ordinary
      margin (`cost_model.min_gain_for`).
    measured: which fields were measured on this device kind rather than
      guessed (for explain).
  """

  name: str
  matmul_flops: float
  matmul_eff: float
  rows_half: float
  decomposition: tuple[tuple[int, float], ...] = ()
  decomposition_scale: float = 1.0
  launch_s: float
  hbm_bw: float
  receive_bw: tuple[float, ...]
  ce_latency_s: float
  dma_op_s: float
  host_op_s: float = 0.0
  host_call_s: float = 0.0
  collective_bw: float
  collective_latency_s: float
  p2p_bw: float
  p2p_latency_s: float
  contention: tuple[tuple[str, float, float], ...]
  calibration: tuple[tuple[str, str, int, str, float, float], ...] = ()
  calibrated_axis_size: int = 0
  pallas_pieces: tuple[tuple[str, tuple[int, ...]], ...] = ()
  push_gather_at: tuple[int, ...] = ()
  checked_at: tuple[tuple[str, tuple[int, ...]], ...] = ()
  measured: tuple[str, ...] = ()

  def __post_init__(self):
    if not self.receive_bw or min(self.receive_bw) <= 0:
      raise ValueError(f"{self.receive_bw=} must be non-empty and positive.")
    if not 0 < self.matmul_eff <= 1:
      raise ValueError(f"{self.matmul_eff=} must be in (0, 1].")
    if self.decomposition_scale < 0:
      raise ValueError(f"{self.decomposition_scale=} must be >= 0.")
    rows = [r for r, _ in self.decomposition]
    if rows != sorted(rows):
      raise ValueError(f"{self.decomposition=} must be sorted by tiles.")

  def model_checked_at(self, op: str, axis_size: int) -> bool:
    """Whether ``op``'s uncalibrated picks over ``axis_size`` devices were
    checked against measurements (`checked_at`)."""
    return _covers(self.checked_at, op, axis_size)

  def pieces_on_pallas(self, op: str, axis_size: int) -> bool:
    """Whether ``op``'s copy-engine pieces run on the Pallas kernel by
    default over ``axis_size`` devices (`pallas_pieces`)."""
    return _covers(self.pallas_pieces, op, axis_size)

  def calibrated_at(self, axis_size: int) -> bool:
    """Whether the calibration applies to ops over ``axis_size`` devices."""
    return bool(self.calibration) and self.calibrated_axis_size in (
        0, axis_size)

  def calibration_of(self, op: str, dataflow: str, num_chunks: int,
                     comm: str, axis_size: int) -> tuple[float, float] | None:
    """``(a, b)`` of a schedule family at ``axis_size``, or None."""
    if not self.calibrated_at(axis_size):
      return None
    for o, d, c, m, a, b in self.calibration:
      if (o, d, c, m) == (op, dataflow, num_chunks, comm):
        return a, b
    return None

  def receive(self, peers: int) -> float:
    """Per-device receive bandwidth with ``peers`` concurrent senders."""
    return self.receive_bw[min(max(peers, 1), len(self.receive_bw)) - 1]

  def contention_of(self, comm: str) -> tuple[float, float]:
    for c, alpha, beta in self.contention:
      if c == comm:
        return alpha, beta
    return 0.0, 0.0


# 4x H200, NVSwitch. Measured: cuBLAS 8192^3 796 TFLOP/s; XLA dots of the
# benchmark shapes fit flops / 729 TFLOP/s + 16 us (hence matmul_eff ~0.92,
# launch); local copy 4.1 TB/s; NCCL all-gather fits 25 us + bytes_in / 326
# GB/s. Fitted (the benchmark command's ``characterize`` and ``heuristic``
# suites, on the data in benchmarks/data/):
# 1. from the characterisation: copy-engine receive bandwidth with 1/2/3
#    peers sending (slope of time vs bytes, P = 2/3/4 devices all copying),
#    the ppermute bandwidth and latency, the contention of each engine, and
#    the efficiency of one dot by its output tiles (single dots, relative
#    to the largest);
# 2. from both ops' schedule benchmarks, fit split only (the gpt3-175b
#    family and M=4096 held out): the per-op terms dma_op_s, ce_latency_s
#    and the copy-engine contention, by least squares on log time ratios
#    within each case;
# 3. the host floor (host_call_s, host_op_s) measured on a host-bound op
#    (below), and, in the package data file
#    data/cost_model/nvidia_h200.json that `params_for` applies on top,
#    decomposition_scale and the per-family calibration, fitted on the fit
#    split of interleaved sweeps of both ops (qwen2-72b and gpt3-175b held
#    out).
_H200 = DeviceParams(
    name="NVIDIA H200",
    matmul_flops=796e12,
    matmul_eff=0.92,
    rows_half=32.0,  # Unused: `decomposition` is measured.
    decomposition=((64, 0.385), (128, 0.6669), (256, 0.8634), (512, 0.8701),
                   (1024, 0.9567), (2048, 0.9966), (4096, 0.9966)),
    launch_s=10e-6,
    hbm_bw=4.1e12,
    receive_bw=(365.7e9, 373.2e9, 338.8e9),
    ce_latency_s=27.3e-6,
    dma_op_s=0.937e-6,
    # Host floor, measured (rs 512x4096x4096, host-bound: 0.044 ms of
    # device work): XLA's program 0.120 ms per call; each
    # start / wait / done triple of the reduce-scatter adds 0.039-0.055 ms
    # (direct / ring c1: 3 triples, 0.235-0.237 ms; c2 / bidirectional: 6,
    # 0.416-0.453 ms), least squares 0.050 ms.
    host_op_s=50e-6,
    host_call_s=120e-6,
    collective_bw=326e9,
    collective_latency_s=25e-6,
    p2p_bw=296.6e9,
    p2p_latency_s=75.5e-6,
    contention=(("dma", 0.0979, 0.122), ("xla", 0.74, 0.74)),
    # The reduce-scatter's pieces are row blocks of h at rank-dependent
    # offsets: the kernel TMA-loads them in place, where XLA's dot needs a
    # slice copy first. In same-run pairs of one schedule on 4xH200 the
    # kernel is faster in 31 of 40, at most 7% slower (ops under 0.5 ms), at
    # most 3% on ops of 1 ms and more. With half-depth steps (K % 64 != 0,
    # qwen2-72b) it loses 6-9%, so those keep XLA's dot. The all-gather's
    # kernels write each product in place into the result, where XLA's dots
    # need one more pass to assemble it: on 2xH200, direct c1 on the kernel
    # against the same on XLA's dot, ten shapes in one run, 1.00-1.13x
    # (geomean 1.04x; benchmarks/results/nvidia_h200_w2/schedules). Not at
    # P = 4, where it was mixed (4xH200, five shapes, one run): llama3-70b
    # at 8192 tokens 1.00x against 1.10x on XLA's dots, llama3-8b and the
    # 16384 square a little ahead, gpt3-175b level.
    pallas_pieces=(("matmul_reduce_scatter", ()), ("all_gather_matmul", (2,))),
    # The pulled gathers wait in the host rendezvous of every peer before
    # their copies start; the push all-gather's peers copy into its window
    # when they reach the op and its GEMMs wait on the device. On 4xH200,
    # in the interleaved runs behind the shipped autotune cache (the ten
    # benchmark shapes, ficco_jax/data/autotune), it was the fastest
    # schedule on all 7 shapes where it ran: 3.6-6.2% ahead of the pulled
    # direct gather (2 shapes), 9.6-12.6% ahead of the ring (3), level with
    # XLA's program on llama3-8b at 4096 tokens. At P = 2 in one process
    # the pulled gather's pieces run on the Pallas kernel, which the push
    # path's GEMMs cannot (they read the window), and the two measured
    # level; there it stays.
    push_gather_at=(4,),
    # At P = 2 the model predicts the all-gather's overlap 4.1-19.6% faster
    # on the ten benchmark shapes, and every one measured faster than XLA's
    # best program (1.01-1.40x, benchmarks/results/nvidia_h200_w2). The
    # reduce-scatter's best overlap is predicted 2.8-9.5% faster there, and
    # direct/c1/dma on the kernel measured 1.01-1.32x over XLA's best on all
    # ten, 1.01-1.11x on the six predicted under 8%
    # (benchmarks/results/nvidia_h200_w2/rs_schedules): the model is
    # pessimistic at P = 2, not optimistic, so the ordinary margin holds.
    checked_at=(("all_gather_matmul", (2,)), ("matmul_reduce_scatter", (2,))),
    measured=("matmul_flops", "matmul_eff", "hbm_bw", "decomposition",
              "receive_bw", "collective_bw", "collective_latency_s",
              "contention[dma]", "contention[xla]", "p2p_bw",
              "p2p_latency_s", "ce_latency_s", "dma_op_s", "host_op_s",
              "host_call_s"),
)

# H100 SXM: the same NVLink4/NVSwitch fabric and SMs as H200 and slower HBM
# (3.35 vs 4.8 TB/s). Nothing here was measured on an H100.
_H100 = dataclasses.replace(
    _H200, name="NVIDIA H100 80GB HBM3", matmul_flops=760e12, hbm_bw=2.9e12,
    pallas_pieces=(), push_gather_at=(), checked_at=(), measured=())

# Unknown devices: a cautious PCIe-class guess, so that overlap is chosen
# only where it wins by a wide margin.
_DEFAULT = DeviceParams(
    name="default",
    matmul_flops=300e12,
    matmul_eff=0.85,
    rows_half=64.0,
    launch_s=15e-6,
    hbm_bw=1.5e12,
    receive_bw=(50e9, 40e9, 30e9),
    ce_latency_s=15e-6,
    dma_op_s=40e-6,
    collective_bw=40e9,
    collective_latency_s=40e-6,
    p2p_bw=40e9,
    p2p_latency_s=40e-6,
    contention=(("dma", 0.1, 0.1), ("xla", 0.5, 0.5)),
)

BUILTIN: dict[str, DeviceParams] = {
    "NVIDIA H200": _H200,
    "NVIDIA H100 80GB HBM3": _H100,
    "default": _DEFAULT,
}


def slug(device_kind: str) -> str:
  """File-name form of a device kind: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "unknown"


def _coerce(name: str, value: Any) -> Any:
  # JSON has lists where the dataclass has tuples (hashability).
  if name == "decomposition":
    return tuple((int(r), float(e)) for r, e in value)
  if name == "contention":
    return tuple((str(c), float(a), float(b)) for c, a, b in value)
  if name == "calibration":
    return tuple((str(o), str(d), int(c), str(m), float(a), float(b))
                 for o, d, c, m, a, b in value)
  if name in ("pallas_pieces", "checked_at"):
    # An op alone (a string) means every axis size.
    return tuple((v, ()) if isinstance(v, str) else
                 (str(v[0]), tuple(int(p) for p in v[1])) for v in value)
  if name in ("receive_bw", "measured"):
    return tuple(value)
  return value


def _replace(base: DeviceParams, fields: Mapping[str, Any]) -> DeviceParams:
  known = {f.name for f in dataclasses.fields(DeviceParams)}
  unknown = set(fields) - known
  if unknown:
    raise ValueError(f"Unknown DeviceParams fields {sorted(unknown)}.")
  return dataclasses.replace(
      base, **{k: _coerce(k, v) for k, v in fields.items()})


@functools.cache
def _fitted(device_kind: str) -> tuple[tuple[str, Any], ...]:
  """The fitted overrides shipped for a device kind (empty when none)."""
  path = DATA_DIR / "cost_model" / f"{slug(device_kind)}.json"
  if not path.exists():
    return ()
  with open(path) as f:
    data = json.load(f)
  return tuple(sorted(data.get("params", {}).items(),
                      key=lambda kv: kv[0]))


def params_for(device_kind: str | None,
               overrides: Mapping[str, Any] | None = None) -> DeviceParams:
  """The parameters the cost model uses for ``device_kind``.

  Args:
    device_kind: a ``jax.Device.device_kind``; unknown kinds (and None) get
      the ``"default"`` entry.
    overrides: field values that replace the result's (e.g. a
      ``receive_bw`` measured on another interconnect).

  Returns:
    Built-in values, then the package's fitted file for that kind, then
    ``overrides``, each replacing the previous field by field.
  """
  base = BUILTIN.get(device_kind or "default", BUILTIN["default"])
  fitted = dict(_fitted(base.name)) if base.name != "default" else {}
  params = _replace(base, fitted) if fitted else base
  return _replace(params, overrides) if overrides else params
