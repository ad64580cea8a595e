"""Predicted time of a collective matmul under a schedule, from static sizes.

The model (FiCCO's two losses on top of a pipeline):

* ``T_mm(rows, K, n)``: roofline ``max(flops / (peak * eff), bytes / hbm)``
  plus a launch cost, where ``eff`` falls for short dots (`_row_eff`). The
  sum over a schedule's pieces minus one unsplit dot is the *decomposition*
  loss.
* Transfers: the schedule's own `plan.GatherPlan` (the same plan the engines
  run), each copy queue serial, queues sharing the device's receive
  bandwidth for that many concurrent peers; ring forwarding waits for the
  piece to reach the neighbour first.
* Pipeline: compute consumes pieces in plan order, each once it has landed;
  while transfers are in flight the matmul is ``1 + alpha`` slower and the
  transfers ``1 + beta`` slower (*contention*, per comm engine).
* ``dataflow="none"``: one XLA collective, then one dot.

All times are seconds. `predict` reports each term so that `explain` can say
why a schedule lost.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ficco_jax._src import device_params
from ficco_jax._src import plan as plan_lib
from ficco_jax._src import schedule as schedule_lib

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
CHUNK_COUNTS = (1, 2, 4, 8)
OVERLAPPED_DATAFLOWS = ("direct", "ring", "bidirectional")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """One op's static sizes, reduced to what the model needs.

  Attributes:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
    axis_size: ``P``.
    split: the dimension pieces are cut along: the local shard's rows for
      the all-gather, the rows each device keeps for the reduce-scatter.
    rows: matmul rows per piece-row unit: the product of every non-contracted
      dim of the local operand divided by ``split`` (1 for 2-D operands).
    k: contraction size.
    n: output columns of the local dot.
    itemsize: bytes per element of the operand (and the result).
    flops_scale: throughput relative to 16-bit dots for this dtype.
  """

  op: str
  axis_size: int
  split: int
  rows: int
  k: int
  n: int
  itemsize: int
  flops_scale: float


def problem(op: str, *, x_shape, w_shape, dtype, axis_size: int,
            axis: int = 0) -> Problem:
  """Normalises an op's local shapes (as seen inside shard_map)."""
  if op not in OPS:
    raise ValueError(f"Unknown {op=}; expected one of {OPS}.")
  x_shape = tuple(int(d) for d in x_shape)
  lead = int(np.prod(x_shape[:-1]))
  split = x_shape[axis]
  if op == "matmul_reduce_scatter":
    split //= axis_size
  rows_per_split = lead // max(x_shape[axis], 1)
  dt = np.dtype(dtype)
  # f32 dots run as TF32 on NVIDIA GPUs by default (half of bf16 peak); f64
  # has a small fraction of the tensor-core rate.
  scale = {1: 2.0, 2: 1.0, 4: 0.5, 8: 0.07}.get(dt.itemsize, 1.0)
  return Problem(op=op, axis_size=axis_size, split=split,
                 rows=rows_per_split, k=x_shape[-1], n=int(w_shape[-1]),
                 itemsize=dt.itemsize, flops_scale=scale)


# ---------------------------------------------------------------- matmul


def _row_eff(rows: float, params: device_params.DeviceParams) -> float:
  """Efficiency of a dot ``rows`` tall relative to a very tall one."""
  table = params.decomposition
  if not table:
    return rows / (rows + params.rows_half)
  xs = [math.log2(max(r, 1)) for r, _ in table]
  # Cumulative max: a measured table is noisy, and a taller dot never runs
  # at lower efficiency in this model (decomposition loss stays monotone).
  ys = list(np.maximum.accumulate([min(e, 1.0) for _, e in table]))
  return float(np.interp(math.log2(max(rows, 1)), xs, ys))


def matmul_time(rows: float, k: int, n: int, *, itemsize: int = 2,
                flops_scale: float = 1.0,
                params: device_params.DeviceParams) -> float:
  """One dot ``[rows, k] @ [k, n]``: roofline with a size-dependent efficiency."""
  if rows <= 0:
    return 0.0
  eff = params.matmul_eff * _row_eff(rows, params) * (
      n / (n + params.rows_half))
  t_flops = 2.0 * rows * k * n / (params.matmul_flops * flops_scale * eff)
  t_bytes = (rows * k + k * n + rows * n) * itemsize / params.hbm_bw
  return max(t_flops, t_bytes) + params.launch_s


def collective_time(bytes_in: float, params: device_params.DeviceParams) -> float:
  """XLA's all-gather / reduce-scatter moving ``bytes_in`` into a device."""
  return params.collective_latency_s + bytes_in / params.collective_bw


# ---------------------------------------------------------------- result


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
  """Predicted time of one schedule, with its parts (seconds).

  Attributes:
    schedule: the schedule predicted.
    total: end-to-end time of the op.
    t_mm: one unsplit dot of all the op's rows (no decomposition).
    t_comm: the schedule's transfers alone, without contention (for
      ``"none"``, the XLA collective).
    compute: the schedule's dots, decomposition and contention included.
    decomposition: ``sum(piece dots) - t_mm``.
    contention: what contention adds to ``total``.
    overhead: fixed per-op costs (DMA rendezvous).
    exposed_comm: ``total - compute - overhead``: communication not hidden.
    links_used: peers a device receives from at once.
    links_available: ``P - 1``.
    receive_bw: bytes/s into a device while its transfers run.
    pieces: dots the schedule runs (1 for ``"none"``).
  """

  schedule: schedule_lib.Schedule
  total: float
  t_mm: float
  t_comm: float
  compute: float
  decomposition: float
  contention: float
  overhead: float
  exposed_comm: float
  links_used: int
  links_available: int
  receive_bw: float
  pieces: int

  @property
  def ideal(self) -> float:
    """``max(T_mm, T_comm)``: perfect overlap of this schedule's parts."""
    return max(self.t_mm, self.t_comm)

  @property
  def bound(self) -> str:
    """``"comm"`` when the transfers alone take longer than the dots."""
    return "comm" if self.t_comm > self.compute else "compute"


# ---------------------------------------------------------------- transfers


def _link_model(comm: str, streams: int, params):
  """(seconds per byte of one transfer, latency, peers at once)."""
  if comm == "dma":
    bw = params.receive(streams)
    # Queues share the device's receive bandwidth.
    return streams / bw, params.ce_latency_s, streams, bw
  # XLA runs collective-permutes one after another on one stream.
  return 1.0 / params.p2p_bw, params.p2p_latency_s, 1, params.p2p_bw


def _gather_arrivals(gplan: plan_lib.GatherPlan, row_bytes: float, comm: str,
                     params, beta: float) -> tuple[list[float], int, float]:
  """Time each landing buffer is complete, transfers as the plan orders them."""
  per_byte, latency, links, bw = _link_model(comm, gplan.num_streams, params)
  queue_free: dict[int, float] = {}
  arrival = [0.0] * len(gplan.landing_rows)
  for t in gplan.transfers:
    q = t.stream if comm == "dma" else 0
    start = queue_free.get(q, 0.0)
    if t.src < 0:
      # By symmetry the neighbour's copy of this piece landed when ours of
      # the same buffer index did.
      start = max(start, arrival[-1 - t.src])
    end = start + latency + t.rows * row_bytes * per_byte * (1 + beta)
    queue_free[q] = end
    arrival[t.dst] = max(arrival[t.dst], end)
  return arrival, links, bw


def _run_pieces(pieces, alpha: float) -> tuple[float, float]:
  """Compute timeline: ``pieces`` = [(duration, ready, comm_busy_until)].

  Returns (end time, total compute time including contention).
  """
  t, busy = 0.0, 0.0
  for d, ready, comm_end in pieces:
    t = max(t, ready)
    overlap = min(d, max(0.0, comm_end - t))
    d = d + alpha * overlap
    t += d
    busy += d
  return t, busy


# ---------------------------------------------------------------- ops


def _mm(prob: Problem, split_rows: float, params) -> float:
  return matmul_time(split_rows * prob.rows, prob.k, prob.n,
                     itemsize=prob.itemsize, flops_scale=prob.flops_scale,
                     params=params)


def _ag_timeline(prob: Problem, sched, params, alpha, beta):
  p = prob.axis_size
  gplan = plan_lib.gather_plan(sched, axis_size=p, shard_rows=prob.split)
  row_bytes = prob.rows * prob.k * prob.itemsize
  arrival, links, bw = _gather_arrivals(gplan, row_bytes, sched.comm, params,
                                        beta)
  last = max(arrival, default=0.0)
  pieces = [(_mm(prob, prob.split, params), 0.0, last)]
  pieces += [(_mm(prob, rows, params), arrival[b], last)
             for b, rows in enumerate(gplan.landing_rows)]
  end, busy = _run_pieces(pieces, alpha)
  dots = sum(d for d, _, _ in pieces)
  return end, busy, dots, last, links, bw, len(pieces)


def _rs_timeline(prob: Problem, sched, params, alpha, beta):
  """Partials computed piece by piece, each sent once computed.

  direct: per chunk, ``P - 1`` partial dots each sent to its owner on its own
  queue, then the own dot. ring / bidirectional: ``P`` accumulate-and-forward
  steps per chunk (two half-rings for bidirectional), each step's send
  waiting for the neighbour's previous step.
  """
  p, c = prob.axis_size, sched.num_chunks
  mc = prob.split / c
  out_row_bytes = prob.rows * prob.n * prob.itemsize
  rings = {"direct": 0, "ring": 1, "bidirectional": 2}[sched.dataflow]
  streams = p - 1 if rings == 0 else rings
  per_byte, latency, links, bw = _link_model(sched.comm, streams, params)
  t = busy = dots = 0.0
  queue_free: dict[int, float] = {}
  last = 0.0
  pieces_rows = []  # (rows, stream or None, waits_for_previous_send)
  for _ in range(c):
    if rings == 0:
      pieces_rows += [(mc, q, False) for q in range(p - 1)] + [(mc, None, False)]
    else:
      part = mc / rings
      for step in range(p):
        for r in range(rings):
          pieces_rows.append((part, r if step < p - 1 else None, step > 0))
  prev_arrival: dict[int, float] = {}
  for rows, q, chained in pieces_rows:
    d = _mm(prob, rows, params)
    dots += d
    d += alpha * d  # Transfers run through nearly all of the compute.
    t += d
    busy += d
    ready = t
    if chained:
      ready = max(ready, prev_arrival.get(q if q is not None else -1, 0.0))
    if q is None:
      continue
    qq = q if sched.comm == "dma" else 0
    start = max(queue_free.get(qq, 0.0), ready)
    end = start + latency + rows * out_row_bytes * per_byte * (1 + beta)
    queue_free[qq] = end
    prev_arrival[q] = end
    last = max(last, end)
  # Received partials are summed once they land (one pass over the output).
  add = prob.split * out_row_bytes * (p - 1) / params.hbm_bw
  end = max(t, last) + add
  return end, busy, dots, last, links, bw, len(pieces_rows)


def predict(prob: Problem, schedule: schedule_lib.Schedule,
            params: device_params.DeviceParams) -> Prediction:
  """Predicted time of ``schedule`` for ``prob`` on a device with ``params``."""
  p = prob.axis_size
  # All rows of the op's one unsplit dot: the gathered operand's, or the
  # local operand's for the reduce-scatter (P times the rows kept).
  t_mm = _mm(prob, prob.split * p, params)
  if prob.op == "all_gather_matmul":
    bytes_in = (p - 1) * prob.split * prob.rows * prob.k * prob.itemsize
  else:
    bytes_in = (p - 1) * prob.split * prob.rows * prob.n * prob.itemsize
  if not schedule.overlapped or p == 1:
    t_comm = collective_time(bytes_in, params) if p > 1 else 0.0
    return Prediction(schedule=schedule, total=t_mm + t_comm, t_mm=t_mm,
                      t_comm=t_comm, compute=t_mm, decomposition=0.0,
                      contention=0.0, overhead=0.0, exposed_comm=t_comm,
                      links_used=p - 1, links_available=p - 1,
                      receive_bw=params.collective_bw, pieces=1)
  timeline = (_ag_timeline if prob.op == "all_gather_matmul"
              else _rs_timeline)
  alpha, beta = params.contention_of(schedule.comm)
  end, busy, dots, _, links, bw, pieces = timeline(prob, schedule, params,
                                                  alpha, beta)
  free_end, _, _, t_comm, _, _, _ = timeline(prob, schedule, params, 0.0, 0.0)
  overhead = params.dma_op_s if schedule.comm == "dma" else 0.0
  total = end + overhead
  return Prediction(
      schedule=schedule, total=total, t_mm=t_mm, t_comm=t_comm, compute=busy,
      decomposition=max(0.0, dots - t_mm), contention=max(0.0, end - free_end),
      overhead=overhead, exposed_comm=max(0.0, total - busy - overhead),
      links_used=links, links_available=p - 1, receive_bw=bw, pieces=pieces)


def candidates(prob: Problem, comms: tuple[str, ...]) -> tuple[
    schedule_lib.Schedule, ...]:
  """``"none"`` and every overlapped dataflow x chunk count x comm that is valid.

  A chunk count is valid when it divides ``prob.split`` (the dimension the
  op cuts into pieces).
  """
  out = [schedule_lib.NO_OVERLAP]
  if prob.axis_size > 1:
    for comm in comms:
      for dataflow in OVERLAPPED_DATAFLOWS:
        for c in CHUNK_COUNTS:
          if prob.split % c == 0 and prob.split // c >= 1:
            out.append(schedule_lib.Schedule(dataflow=dataflow, num_chunks=c,
                                             comm=comm))
  return tuple(out)


def rank(prob: Problem, params: device_params.DeviceParams,
         comms: tuple[str, ...]) -> tuple[Prediction, ...]:
  """Every candidate's prediction, fastest first (ties: fewer chunks first)."""
  preds = [predict(prob, s, params) for s in candidates(prob, comms)]
  return tuple(sorted(preds, key=lambda pr: (pr.total, pr.schedule.num_chunks)))


MIN_GAIN = 0.03
"""Overlap only when predicted at least this much faster than ``"none"``: the
model's error is a few percent, and a schedule that only ties costs extra
compile time and, for comm='dma', host rendezvous that can stall."""


def best(preds: tuple[Prediction, ...], min_gain: float = MIN_GAIN) -> Prediction:
  """The fastest prediction, or ``"none"``'s unless overlap wins by ``min_gain``."""
  none = next(pr for pr in preds if not pr.schedule.overlapped)
  top = min(preds, key=lambda pr: (pr.total, pr.schedule.num_chunks))
  if top.schedule.overlapped and top.total <= none.total * (1 - min_gain):
    return top
  return none
