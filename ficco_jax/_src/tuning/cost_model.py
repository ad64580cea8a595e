"""Predicted time of a collective matmul under a schedule, from static sizes.

The model (FiCCO's two losses on top of a pipeline):

* ``T_mm(rows, K, n)``: roofline ``max(flops / (peak * eff), bytes / hbm)``
  plus a launch cost, where ``eff`` falls for dots with few output tiles
  (`_dot_eff`: too few to fill the SMs). The
  sum over a schedule's pieces minus one unsplit dot is the *decomposition*
  loss.
* Transfers: the schedule's own `plan.GatherPlan` (the same plan the engines
  run), each copy queue serial, queues sharing the device's receive
  bandwidth for that many concurrent peers; ring forwarding waits for the
  piece to reach the neighbour first.
* Pipeline: compute consumes pieces in plan order, each once it has landed;
  while transfers are in flight the matmul is ``1 + alpha`` slower and the
  transfers ``1 + beta`` slower (*contention*, per comm engine).
* Fixed costs of comm='dma': every copy-engine op (one start / wait / done
  of the peer-copy protocol) costs ``dma_op_s`` on the device (the
  cross-device event waits of its start and done) and ``host_op_s`` on the
  host (the rendezvous of the device threads in start and done). An
  all-gather is one such op; a reduce-scatter is one per partial sent
  (direct) or per ring hop: ``c (P - 1)`` per ring.
* Host: an op cannot finish before the host has issued it, so ``total =
  max(device time, host time)``, the host time being ``host_call_s`` (one
  dispatch of the op's program) plus ``host_op_s`` per copy-engine op.
  Copy-engine ops with many hops on small shapes are host-bound.
* ``dataflow="none"``: one XLA collective, then one dot.
* Calibration: the component model misjudges some schedule families by
  10-20% on H200 (host-bound issue of short ops, copy queues sharing links);
  ``DeviceParams.calibration`` holds a per-family correction fitted on
  benchmark runs, applied to the total (`predict`; `predict_uncalibrated`
  is the model alone), and the heuristic only returns families it covers
  (`eligible`).

All times are seconds. `predict` reports each term so that `explain` can say
why a schedule lost.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ficco_jax._src import plan as plan_lib
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src.tuning import device_params

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


TILE = 128
"""Side of the output tile `decomposition` counts a dot's parallelism in."""


def _dot_eff(rows: float, n: int, params: device_params.DeviceParams) -> float:
  """Efficiency of a dot ``[rows, k] @ [k, n]`` relative to a very large one.

  With a measured ``decomposition`` table, by the dot's output tiles
  (``rows * n / TILE**2``): a GPU runs a dot with too few tiles to fill its
  SMs in partial waves, whatever the contraction. Without one,
  ``r / (r + rows_half)`` for each of rows and columns.
  """
  table = params.decomposition
  if not table:
    return rows / (rows + params.rows_half) * n / (n + params.rows_half)
  xs = [math.log2(max(t, 1)) for t, _ in table]
  # Cumulative max: a measured table is noisy, and a larger dot never runs
  # at lower efficiency in this model (decomposition loss stays monotone).
  ys = list(np.maximum.accumulate([min(e, 1.0) for _, e in table]))
  tiles = rows * n / TILE**2
  eff = float(np.interp(math.log2(max(tiles, 1)), xs, ys))
  return max(0.05, 1.0 - params.decomposition_scale * (1.0 - eff))


def matmul_time(rows: float, k: int, n: int, *, itemsize: int = 2,
                flops_scale: float = 1.0,
                params: device_params.DeviceParams) -> float:
  """One dot ``[rows, k] @ [k, n]``: roofline with a size-dependent efficiency."""
  if rows <= 0:
    return 0.0
  eff = params.matmul_eff * _dot_eff(rows, n, params)
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
    overhead: fixed device-side costs of the copy-engine ops.
    host: time the host needs to issue the op (the uncalibrated total,
      ``total / calibration``, is at least this).
    device: time the devices need (likewise).
    dma_ops: copy-engine ops (start / wait / done) the schedule runs.
    exposed_comm: ``total - compute - overhead`` of the uncalibrated
      total: communication not hidden (and host time the device waits for).
    links_used: peers a device receives from at once.
    links_available: ``P - 1``.
    receive_bw: bytes/s into a device while its transfers run.
    pieces: dots the schedule runs (1 for ``"none"``).
    calibration: the factor the fitted calibration of this schedule's
      family applied to ``total`` (1.0: none; see
      ``DeviceParams.calibration``). Every other field is the component
      model's, uncalibrated.
  """

  schedule: schedule_lib.Schedule
  total: float
  t_mm: float
  t_comm: float
  compute: float
  decomposition: float
  contention: float
  overhead: float
  host: float
  device: float
  dma_ops: int
  exposed_comm: float
  links_used: int
  links_available: int
  receive_bw: float
  pieces: int
  calibration: float = 1.0

  @property
  def ideal(self) -> float:
    """``max(T_mm, T_comm)``: perfect overlap of this schedule's parts."""
    return max(self.t_mm, self.t_comm)

  @property
  def bound(self) -> str:
    """``"host"`` when issuing takes longer than running; else ``"comm"``
    when the transfers alone take longer than the dots; else ``"compute"``."""
    # The component model's own total: the parts are uncalibrated too.
    if self.host >= self.total / self.calibration:
      return "host"
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
  """Time each landing buffer is complete, transfers as the plan orders them.

  comm='dma': each queue runs its transfers in plan order, each starting
  ``ce_latency_s`` after the previous one on its queue ended (and, when it
  forwards a piece, after that piece landed); the queues moving bytes at a
  moment share the receive bandwidth of that many peers, so a queue that
  runs alone (the long chain of a bidirectional ring) gets all of it.
  comm='xla': the permutes run one after another.
  """
  transfers = gplan.transfers
  arrival = [0.0] * len(gplan.landing_rows)
  if comm != "dma":
    per_byte, latency, links, bw = _link_model(comm, gplan.num_streams, params)
    t = 0.0
    for tr in transfers:
      if tr.src < 0:
        t = max(t, arrival[-1 - tr.src])
      t += latency + tr.rows * row_bytes * per_byte * (1 + beta)
      arrival[tr.dst] = max(arrival[tr.dst], t)
    return arrival, links, bw
  n = len(transfers)
  left = [tr.rows * row_bytes * (1 + beta) for tr in transfers]
  into = [0] * len(gplan.landing_rows)  # Transfers still to land, per buffer.
  for tr in transfers:
    into[tr.dst] += 1
  queues: dict[int, list[int]] = {}
  for i, tr in enumerate(transfers):
    queues.setdefault(tr.stream, []).append(i)
  free = {q: 0.0 for q in queues}  # When each queue's last transfer ended.
  active: set[int] = set()
  now, done = 0.0, 0
  while done < n:
    # When each idle queue's next transfer can start moving bytes.
    starts = {}
    for q, todo in queues.items():
      if todo and todo[0] not in active:
        tr = transfers[todo[0]]
        if tr.src < 0 and into[-1 - tr.src]:
          continue  # The piece it forwards has not landed yet.
        dep = arrival[-1 - tr.src] if tr.src < 0 else 0.0
        starts[todo[0]] = max(free[q], dep) + params.ce_latency_s
    rate = (params.receive(len(active)) / len(active)) if active else 0.0
    finish = min((now + left[i] / rate for i in active), default=math.inf)
    begin = min(starts.values(), default=math.inf)
    step = max(min(finish, begin), now)
    for i in active:
      left[i] -= rate * (step - now)
    now = step
    for i in sorted(active):
      if left[i] <= 1e-9 * (1 + transfers[i].rows * row_bytes):
        tr = transfers[i]
        active.discard(i)
        queues[tr.stream].pop(0)
        free[tr.stream] = now
        into[tr.dst] -= 1
        arrival[tr.dst] = max(arrival[tr.dst], now)
        done += 1
    for i, t0 in starts.items():
      if t0 <= now:
        active.add(i)
  links = gplan.num_streams
  return arrival, links, params.receive(links)


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
  if sched.granularity(prob.op) == "step":
    # One dot per landing buffer (every peer's piece of a direct step).
    pieces += [(_mm(prob, rows, params), arrival[b], last)
               for b, rows in enumerate(gplan.landing_rows)]
  else:
    pieces += [(_mm(prob, blk.rows, params), arrival[blk.landing], last)
               for blk in gplan.blocks]
  end, busy = _run_pieces(pieces, alpha)
  dots = sum(d for d, _, _ in pieces)
  return end, busy, dots, last, links, bw, len(pieces)


def _rs_timeline(prob: Problem, sched, params, alpha, beta):
  """Partials computed piece by piece, each sent once computed.

  Follows the program order of `ops/matmul_reduce_scatter` (`direct_dma`,
  `ring_dma`) for comm='dma' (comm='xla' direct with several chunks sums
  each chunk as it goes; modelled alike).
  ring / bidirectional: per
  chunk and ring (the two rings of bidirectional one after the other, half
  of the rows each), ``P`` accumulate-and-forward steps: the running sum
  goes to the neighbour while the next partial is multiplied, then the
  compute stream waits for the neighbour's sum and adds it. direct: per
  chunk, ``P - 1`` partial dots, each pulled by its owner (one peer at a
  time, one queue) while the next is multiplied; the own rows' dot hides the
  last pull, then one pass sums them. direct with ``compute_granularity=
  "step"``: per chunk one dot of the ``P - 1`` peers' rows (after copying
  them together, with XLA's dot), then all peers pull their slot at once,
  sharing the receive bandwidth of ``P - 1`` peers; ``"halving"``: the
  same per peer group (`Schedule.peer_groups`); ``"flagged"``: piece's
  timeline run by one kernel at the whole dot's efficiency, one launch and
  one start. A dot is ``1 + alpha`` slower for as long as a transfer is in
  flight.
  """
  p, c = prob.axis_size, sched.num_chunks
  mc = prob.split / c
  out_row_bytes = prob.rows * prob.n * prob.itemsize
  direct = sched.dataflow == "direct"
  rings = 2 if sched.dataflow == "bidirectional" and mc >= 2 else 1
  # One transfer in flight at a time: a direct step is a permutation, and
  # the two rings of bidirectional run one after the other.
  per_byte, latency, links, bw = _link_model(sched.comm, 1, params)
  state = {"t": 0.0, "busy": 0.0, "dots": 0.0, "comm_end": 0.0, "last": 0.0,
           "pieces": 0}

  def dot(rows, d=None):
    # ``d``: the dot's own time where one kernel runs several pieces.
    d = _mm(prob, rows, params) if d is None else d
    overlap = min(d, max(0.0, state["comm_end"] - state["t"]))
    state["dots"] += d
    state["pieces"] += 1
    d += alpha * overlap
    state["t"] += d
    state["busy"] += d

  def send(rows, start, peers=1):
    # ``peers`` pieces of ``rows`` rows each. More than one: comm='dma', each
    # on its own queue at once, sharing the receive bandwidth of that many.
    rate = per_byte if peers == 1 else peers / params.receive(peers)
    end = start + latency + rows * out_row_bytes * rate * (1 + beta)
    state["comm_end"] = max(state["comm_end"], end)
    state["last"] = max(state["last"], end)
    return end

  def add(rows, parts):
    # Summing landed partials into the result: one pass over them.
    state["t"] += rows * out_row_bytes * (parts + 1) / params.hbm_bw

  if direct and sched.granularity(prob.op) == "flagged":
    # One kernel computes every piece back to back (each chunk's peers'
    # partials, then the own rows) at the efficiency of the op's whole dot,
    # and each partial's pull starts as its flag completes, one pull after
    # another on the receiving queue (one peer at a time), as with
    # "piece"; the own rows hide the last pulls.
    share = _mm(prob, prob.split * p, params) / (p * c)
    for _ in range(c):
      for _ in range(p - 1):
        dot(mc, share)
        send(mc, max(state["t"], state["comm_end"]))
    state["pieces"] -= c * (p - 1) - 1  # One launch for every piece.
    for _ in range(c):
      dot(mc, share)
    state["pieces"] -= c
    state["t"] = max(state["t"], state["comm_end"])
    add(prob.split, p - 1)
  elif direct:
    # Per chunk, one dot per peer group (`Schedule.peer_groups`: one peer
    # each by default, all P - 1 with "step"), then the group's peers pull
    # their slots. One peer: one queue, each step a permutation, one pull
    # after another. Several (comm='dma'): each on its own queue at once,
    # sharing this rank's receive bandwidth; with comm='xla' one ppermute
    # per peer, one after another.
    k_row_bytes = prob.rows * prob.k * prob.itemsize
    groups = sched.peer_groups(prob.op, p)
    widest = max(groups, default=1)
    if sched.comm == "dma" and widest > 1:
      links, bw = widest, params.receive(widest)
    for _ in range(c):
      for g in groups:
        if g > 1 and sched.compute != "pallas":
          # XLA's dot: the group's rows copied into one operand first (the
          # Pallas kernel reads them in place).
          state["t"] += g * mc * k_row_bytes * 2 / params.hbm_bw
        dot(g * mc)
        if sched.comm == "dma":
          send(mc, max(state["t"], state["comm_end"]), peers=g)
        else:
          for _ in range(g):
            send(mc, max(state["t"], state["comm_end"]))
    dot(prob.split)  # The own rows, hiding the last pulls.
    state["t"] = max(state["t"], state["comm_end"])
    add(prob.split, p - 1)
  else:
    part = mc / rings
    for _ in range(c):
      for _ in range(rings):
        dot(part)
        for _ in range(1, p):
          arrival = send(part, state["t"])
          dot(part)
          state["t"] = max(state["t"], arrival)
          add(part, 1)
  return (state["t"], state["busy"], state["dots"], state["last"], links, bw,
          state["pieces"])


def dma_ops(prob: Problem, schedule: schedule_lib.Schedule) -> int:
  """Copy-engine ops (start / wait / done) a comm='dma' schedule runs.

  The all-gather issues its whole plan in one start. The reduce-scatter
  starts once per peer group of a chunk (direct: ``P - 1`` per chunk; one
  with ``compute_granularity="step"``; ``ceil(log2 P)`` with
  ``"halving"``), once per op with ``"flagged"``, or per ring hop (``P - 1`` per chunk and ring, two rings
  for bidirectional, one when a chunk has a single row).
  """
  if schedule.comm != "dma" or not schedule.overlapped or prob.axis_size < 2:
    return 0
  if prob.op == "all_gather_matmul":
    return 1
  c, p = schedule.num_chunks, prob.axis_size
  if schedule.dataflow == "direct" and schedule.granularity(
      prob.op) == "flagged":
    return 1  # One start hands every pull of the op to the copy engines.
  if schedule.dataflow == "direct":
    return c * len(schedule.peer_groups(prob.op, p))
  rings = 2 if (schedule.dataflow == "bidirectional"
                and prob.split // c >= 2) else 1
  return c * rings * (p - 1)


def family(op: str, schedule: schedule_lib.Schedule) -> str:
  """The dataflow name a schedule's calibration is filed under.

  A granularity other than the op's default is its own family
  (``"direct:step"``): it runs other dots and starts, so the default's
  fitted correction does not carry over.
  """
  if schedule.granularity(op) == schedule.default_granularity(op):
    return schedule.dataflow
  return f"{schedule.dataflow}:{schedule.granularity(op)}"


def predict(prob: Problem, schedule: schedule_lib.Schedule,
            params: device_params.DeviceParams) -> Prediction:
  """Predicted time of ``schedule`` for ``prob`` on a device with ``params``.

  The component model (`predict_uncalibrated`), then the fitted correction
  of the schedule's family, if ``params`` has one.
  """
  pr = predict_uncalibrated(prob, schedule, params)
  ab = params.calibration_of(prob.op, family(prob.op, schedule),
                             schedule.num_chunks,
                             schedule.comm if schedule.overlapped else "xla",
                             prob.axis_size)
  if ab is None or pr.total <= 0:
    return pr
  a, b = ab
  factor = math.exp(a + b * math.log(pr.total / 1e-3))
  return dataclasses.replace(pr, total=pr.total * factor, calibration=factor)


def predict_uncalibrated(prob: Problem, schedule: schedule_lib.Schedule,
                         params: device_params.DeviceParams) -> Prediction:
  """The component model alone (no fitted family correction)."""
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
    host = params.host_call_s
    total = max(t_mm + t_comm, host)
    return Prediction(schedule=schedule, total=total, t_mm=t_mm,
                      t_comm=t_comm, compute=t_mm, decomposition=0.0,
                      contention=0.0, overhead=0.0, host=host,
                      device=t_mm + t_comm, dma_ops=0,
                      exposed_comm=total - t_mm,
                      links_used=p - 1, links_available=p - 1,
                      receive_bw=params.collective_bw, pieces=1)
  timeline = (_ag_timeline if prob.op == "all_gather_matmul"
              else _rs_timeline)
  alpha, beta = params.contention_of(schedule.comm)
  end, busy, dots, _, links, bw, pieces = timeline(prob, schedule, params,
                                                  alpha, beta)
  free_end, _, _, t_comm, _, _, _ = timeline(prob, schedule, params, 0.0, 0.0)
  ops = dma_ops(prob, schedule)
  overhead = params.dma_op_s * ops
  host = params.host_call_s + params.host_op_s * ops
  total = max(end + overhead, host)
  return Prediction(
      schedule=schedule, total=total, t_mm=t_mm, t_comm=t_comm, compute=busy,
      decomposition=max(0.0, dots - t_mm), contention=max(0.0, end - free_end),
      overhead=overhead, host=host, device=end + overhead, dma_ops=ops,
      exposed_comm=max(0.0, total - busy - overhead),
      links_used=links, links_available=p - 1, receive_bw=bw, pieces=pieces)


def candidates(prob: Problem, comms: tuple[str, ...]) -> tuple[
    schedule_lib.Schedule, ...]:
  """``"none"`` and every overlapped dataflow x chunk count x comm that is valid.

  A chunk count is valid when it divides ``prob.split`` (the dimension the
  op cuts into pieces). The reduce-scatter's direct dataflow comes at every
  compute granularity (the default ``"piece"``; ``"step"``, which trades
  overlap for fewer copy-engine starts; and ``"halving"``, between them,
  where it differs from both: from 4 devices on); the all-gather's only at
  its default, one dot per step, which never issues more copy-engine ops.
  """
  out = [schedule_lib.NO_OVERLAP]
  if prob.axis_size > 1:
    for comm in comms:
      for dataflow in OVERLAPPED_DATAFLOWS:
        for c in CHUNK_COUNTS:
          if prob.split % c == 0 and prob.split // c >= 1:
            out.append(schedule_lib.Schedule(dataflow=dataflow, num_chunks=c,
                                             comm=comm))
            if (prob.op == "matmul_reduce_scatter" and dataflow == "direct"
                and prob.axis_size > 2):
              out.append(schedule_lib.Schedule(
                  dataflow=dataflow, num_chunks=c, comm=comm,
                  compute_granularity="step"))
              if prob.axis_size > 3:  # Else the same groups as "piece".
                out.append(schedule_lib.Schedule(
                    dataflow=dataflow, num_chunks=c, comm=comm,
                    compute_granularity="halving"))
  return tuple(out)


def _order(pr: Prediction):
  # Ties (several schedules waiting on the host alike): less device time
  # first, then fewer chunks.
  return (pr.total, pr.device, pr.schedule.num_chunks)


def rank(prob: Problem, params: device_params.DeviceParams,
         comms: tuple[str, ...]) -> tuple[Prediction, ...]:
  """Every candidate's prediction, fastest first (ties: less device time,
  then fewer chunks)."""
  preds = [predict(prob, s, params) for s in candidates(prob, comms)]
  return tuple(sorted(preds, key=_order))


MIN_GAIN = 0.03
"""Overlap only when predicted at least this much faster than ``"none"``: the
model's error is a few percent, and a schedule that only ties costs extra
compile time and, for comm='dma', host rendezvous that can stall."""

UNCALIBRATED_MIN_GAIN = 0.08
"""The margin where no fitted calibration applies and the model's picks were
not checked against measurements (an axis size never measured, a device
kind never measured): there the component model alone can be several
percent off in either direction, and 8% keeps ``schedule=None`` from leaving
XLA's program on optimism. Where the picks were checked
(`DeviceParams.checked_at`), the ordinary `MIN_GAIN` applies."""


def min_gain_for(params: device_params.DeviceParams, axis_size: int,
                 op: str | None = None) -> float:
  """The margin overlap must be predicted to win by on this device and axis.

  ``MIN_GAIN`` where a fitted calibration applies, or where the model's
  picks for ``op`` at this axis size were checked against measurements
  and held (``params.checked_at``: on H200 both ops at P = 2); elsewhere
  ``UNCALIBRATED_MIN_GAIN``.
  """
  if params.calibrated_at(axis_size):
    return MIN_GAIN
  if op is not None and params.model_checked_at(op, axis_size):
    return MIN_GAIN
  return UNCALIBRATED_MIN_GAIN


def eligible(params: device_params.DeviceParams, op: str,
             schedule: schedule_lib.Schedule, axis_size: int) -> bool:
  """Whether the heuristic may return ``schedule`` on this device kind.

  Where a fitted calibration applies (``params.calibrated_at(axis_size)``),
  only the families it covers: those were measured on this device kind, and
  the component model alone misjudges some families by 10-20% (the
  ``heuristic`` benchmark suite's report), so an unmeasured family would
  win on optimism. Elsewhere, every candidate.
  """
  if not params.calibrated_at(axis_size) or not schedule.overlapped:
    return True
  return params.calibration_of(op, family(op, schedule), schedule.num_chunks,
                               schedule.comm, axis_size) is not None


def best(preds: tuple[Prediction, ...], min_gain: float = MIN_GAIN,
         allowed=None) -> Prediction:
  """The fastest prediction, or ``"none"``'s unless overlap wins by ``min_gain``.

  Args:
    preds: predictions, ``"none"``'s among them.
    min_gain: the margin overlap must win by.
    allowed: optional predicate on a schedule (e.g. `eligible`); others are
      skipped.
  """
  none = next(pr for pr in preds if not pr.schedule.overlapped)
  pool = [pr for pr in preds if allowed is None or allowed(pr.schedule)]
  top = min(pool or [none], key=_order)
  if top.schedule.overlapped and top.total <= none.total * (1 - min_gain):
    return top
  return none
