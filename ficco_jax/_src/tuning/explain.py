"""``ficco_jax.explain``: which schedule ``schedule=None`` runs, and why."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ficco_jax._src import resolve
from ficco_jax._src import schedule as schedule_lib
from ficco_jax._src import validation
from ficco_jax._src.tuning import cost_model
from ficco_jax._src.tuning import device_params
from ficco_jax._src.tuning import heuristics
from ficco_jax._src.tuning import moe_heuristic


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """One candidate's prediction and, unless it was chosen, why it lost."""

  prediction: cost_model.Prediction
  verdict: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Explanation:
  """The report `explain` returns; ``str()`` (or ``print``) renders it.

  Attributes:
    op, x_shape, w_shape, dtype, axis_size, axis: the problem (local shapes).
    device_kind: the device planned for.
    params: the cost-model constants used.
    chosen: the schedule ``schedule=None`` resolves to.
    source: ``"autotune cache"`` or ``"heuristic"``.
    reason: why (the heuristic's words, or the cache's).
    transport: how ``chosen``'s pieces travel (`Schedule.transport`;
      None for ``comm="xla"``), taking the axis to span processes when
      this job has several.
    t_mm_s: one unsplit dot of all the op's rows.
    t_comm_s: XLA's collective alone (what ``"none"`` exposes).
    ideal_s: ``max(t_mm_s, t_comm_s)``.
    chosen_prediction: the model's prediction for ``chosen``.
    candidates: every candidate, fastest predicted first.
  """

  op: str
  x_shape: tuple[int, ...]
  w_shape: tuple[int, ...]
  dtype: str
  axis_size: int
  axis: int
  device_kind: str
  params: device_params.DeviceParams
  chosen: schedule_lib.Schedule
  source: str
  reason: str
  transport: str | None
  t_mm_s: float
  t_comm_s: float
  ideal_s: float
  chosen_prediction: cost_model.Prediction
  candidates: tuple[Candidate, ...]

  def __str__(self) -> str:
    ms = lambda t: f"{t * 1e3:.3f}"  # noqa: E731
    pr = self.chosen_prediction
    lines = [
        f"ficco_jax.explain: {self.op} x{list(self.x_shape)}"
        f" w{list(self.w_shape)} {self.dtype}, axis {self.axis}, P="
        f"{self.axis_size}, on {self.device_kind!r} (model params:"
        f" {self.params.name!r})",
        f"chosen: {self.chosen.short()}  [{self.source}: {self.reason}]"
        + (f"; pieces travel by the {self.transport} transport"
           if self.transport else ""),
        f"T_mm {ms(self.t_mm_s)} ms, T_comm (XLA collective)"
        f" {ms(self.t_comm_s)} ms, ideal max(T_mm, T_comm)"
        f" {ms(self.ideal_s)} ms; chosen predicted {ms(pr.total)} ms"
        f" (decomposition {ms(pr.decomposition)}, contention"
        f" {ms(pr.contention)}, exposed comm {ms(pr.exposed_comm)} ms;"
        f" host issues it in {ms(pr.host)} ms)",
        "",
        f"{'schedule':<26}{'total':>8}{'compute':>9}{'comm':>8}"
        f"{'decomp':>8}{'content':>9}{'exposed':>9}{'links':>7}  verdict",
    ]
    for c in self.candidates:
      p = c.prediction
      lines.append(
          f"{p.schedule.short():<26}{ms(p.total):>8}{ms(p.compute):>9}"
          f"{ms(p.t_comm):>8}{ms(p.decomposition):>8}{ms(p.contention):>9}"
          f"{ms(p.exposed_comm):>9}{p.links_used:>4}/{p.links_available:<2}"
          f"  {c.verdict}")
    lines.append("(times in ms; compute includes decomposition and"
                 " contention; links: peers a device receives from at once)")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeExplanation:
  """`explain`'s report for a MoE op; ``str()`` (or ``print``) renders it.

  Attributes:
    op, x_shape, w_shape, dtype, axis_size: the problem (local shapes).
    device_kind: the device planned for.
    chosen: the schedule ``schedule=None`` resolves to.
    source: ``"autotune cache"`` or ``"heuristic"``.
    reason: why, in words (`moe_heuristic.decide`).
    expert_width: the experts' hidden width f the exchange rule reads.
    direct_max_f: the widest f that takes the copy engines.
    kernel: why the grouped kernel cannot take the call, or None.
  """

  op: str
  x_shape: tuple[int, ...]
  w_shape: tuple[int, ...]
  dtype: str
  axis_size: int
  device_kind: str
  chosen: schedule_lib.Schedule
  source: str
  reason: str
  expert_width: int
  direct_max_f: int
  kernel: str | None

  def __str__(self) -> str:
    return "\n".join([
        f"ficco_jax.explain: {self.op} x{list(self.x_shape)}"
        f" w{list(self.w_shape)} {self.dtype}, P={self.axis_size}, on"
        f" {self.device_kind!r}",
        f"chosen: {self.chosen.short()}  [{self.source}: {self.reason}]",
        f"grouped kernel: {self.kernel or 'takes the call'}; experts' width"
        f" f={self.expert_width} (copy engines at f <="
        f" {self.direct_max_f})",
    ])


def _on_xla_dots(s: schedule_lib.Schedule) -> schedule_lib.Schedule | None:
  """``s`` with XLA's dots instead of the Pallas kernel, or None where no
  such schedule exists (the flagged granularity is the kernel's own)."""
  if s.compute_granularity == "flagged":
    return None
  return dataclasses.replace(s, compute="xla", num_sms=None,
                             reduce_in_epilogue=False)


def _why_lost(p: cost_model.Prediction, chosen: cost_model.Prediction,
              none: cost_model.Prediction, gated: str | None,
              eligible: bool = True,
              margin: float = cost_model.MIN_GAIN,
              pushed: schedule_lib.Schedule | None = None) -> str:
  """The main term that makes ``p`` slower than ``chosen``, in words.

  ``pushed``: the model's pick where the heuristic runs it as the push
  all-gather instead.
  """
  if p.schedule == chosen.schedule:
    return "chosen"
  if p.schedule == pushed:
    return ("the model's pick; the heuristic runs the same single-chunk"
            " gather as the push all-gather (the reason says why)")
  if (p.schedule.compute == "xla" and chosen.schedule.compute == "pallas"
      and p.schedule == _on_xla_dots(chosen.schedule)):
    # The model times XLA's dot for both (DeviceParams.pallas_pieces).
    return ("same pieces on XLA's dot; the chosen schedule runs them on"
            " the Pallas kernel, measured faster")
  slower = f"+{100 * (p.total / chosen.total - 1):.1f}%"
  if gated is not None and p.schedule.overlapped:
    return f"not considered ({gated})"
  if not eligible:
    return ("not considered (family never measured on this device kind;"
            " the model alone is not trusted for it)")
  if p.total <= chosen.total:
    if not chosen.schedule.overlapped:
      gain = 100 * (1 - p.total / none.total)
      return (f"{gain:.1f}% faster than none, below the"
              f" {100 * margin:.0f}% margin")
    return "predicted no slower; the choice came from measurements"
  if not p.schedule.overlapped:
    return (f"{slower}: no overlap, the collective's"
            f" {p.t_comm * 1e3:.3f} ms are all exposed")
  links = (f"uses {p.links_used} of {p.links_available} links at"
           f" {p.receive_bw / 1e9:.0f} GB/s in")
  if p.bound == "host" and p.host > chosen.total / chosen.calibration:
    return (f"{slower}: host-bound, issuing the call and its {p.dma_ops}"
            f" copy-engine ops takes {p.host * 1e3:.3f} ms")
  if p.bound == "comm":
    return f"{slower}: comm-bound, {links}"
  terms = {
      "exposed comm": p.exposed_comm - chosen.exposed_comm,
      "decomposition": p.decomposition - chosen.decomposition,
      "contention": p.contention - chosen.contention,
      "overhead": p.overhead - chosen.overhead,
  }
  what, extra = max(terms.items(), key=lambda kv: kv[1])
  detail = {
      "exposed comm": f"waits for transfers, {links}",
      "decomposition": f"{p.pieces} smaller dots instead of one",
      "contention": f"comm='{p.schedule.comm}' slows the overlapped dots",
      "overhead": f"fixed cost of {p.dma_ops} copy-engine ops",
  }[what]
  return f"{slower}: {what} +{extra * 1e3:.3f} ms ({detail})"


def explain(op: str, *, x_shape, w_shape, dtype, axis_size: int,
            axis: int = 0, device_kind: str | None = None
            ) -> Explanation | MoeExplanation:
  """Explains the schedule ``schedule=None`` resolves to for one problem.

  Resolves as the ops do (`ficco_jax._src.resolve`: autotune cache, then
  heuristic) and reports the cost model's prediction for every candidate.

  Args:
    op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``; or a MoE
      op, ``"all_to_all_matmul"`` or ``"matmul_all_to_all"`` (for calls
      with no ``precision`` and the result in the operands' dtype), whose
      report is a `MoeExplanation`: the rule that decided, not a cost model.
    x_shape: local shape of the first operand (as inside ``shard_map``).
    w_shape: local shape of ``w``.
    dtype: as for `ficco_jax.choose_schedule`: ``jnp.result_type(x, w)``
      for the tensor-parallel ops, ``x``'s for the MoE ops.
    axis_size: devices along the axis.
    axis: the gathered / scattered axis.
    device_kind: the device to plan for. None: this process's devices,
      with their real platform and libraries. Another kind is planned for
      as a GPU of that kind with the copy-engine library available.

  Returns:
    An `Explanation` (a `MoeExplanation` for the MoE ops); ``print`` it for
    the report.
  """
  resolution = resolve.default_schedule(
      op, x_shape=x_shape, w_shape=w_shape, dtype=dtype, axis_size=axis_size,
      axis=axis, device_kind=device_kind)
  tgt = resolution.target
  if op in resolve.MOE_OPS:
    w_shape = tuple(int(d) for d in w_shape)
    return MoeExplanation(
        op=op, x_shape=tuple(int(d) for d in x_shape), w_shape=w_shape,
        dtype=np.dtype(dtype).name, axis_size=axis_size,
        device_kind=tgt.device_kind, chosen=resolution.schedule,
        source=resolution.source, reason=resolution.reason,
        expert_width=moe_heuristic.expert_width(op, w_shape),
        direct_max_f=moe_heuristic.DIRECT_MAX_F,
        kernel=moe_heuristic.kernel_unfit(
            w_shape=w_shape, dtype=dtype, hopper=resolve.moe_hopper(tgt),
            device_desc=tgt.device_kind))
  x_shape = tuple(int(d) for d in x_shape)
  w_shape = tuple(int(d) for d in w_shape)
  # As the op keys and plans it (default_schedule checked it already).
  axis = validation.normalize_axis("axis", axis, len(x_shape), x_shape)
  params = device_params.params_for(tgt.device_kind)
  chosen, source, reason = (resolution.schedule, resolution.source,
                            resolution.reason)
  gated = heuristics.gate(op, x_shape=x_shape, dtype=dtype,
                          axis_size=axis_size, axis=axis,
                          platform=tgt.platform)
  if tgt.assume_dma and gated == heuristics.NO_DMA_LIBRARY:
    gated = None
  if source == "autotune cache":
    decided, _ = heuristics.decide(
        op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
        axis_size=axis_size, axis=axis, platform=tgt.platform, params=params,
        assume_dma=tgt.assume_dma, processes=jax.process_count())
    reason = (f"measured fastest (the heuristic alone would pick"
              f" {decided.short()})")
    gated = None
  prob = cost_model.problem(op, x_shape=x_shape, w_shape=w_shape, dtype=dtype,
                            axis_size=axis_size, axis=axis)
  preds = list(cost_model.rank(prob, params, comms=heuristics.COMMS))
  if chosen not in [pr.schedule for pr in preds]:
    # A cached schedule outside the heuristic's candidate set.
    preds.append(cost_model.predict(prob, chosen, params))
  none = next(pr for pr in preds if not pr.schedule.overlapped)
  margin = cost_model.min_gain_for(params, axis_size, op)
  eligible = lambda s: cost_model.eligible(params, op, s, axis_size)  # noqa: E731
  pushed = None
  if source == "heuristic" and chosen == heuristics.PUSH_GATHER:
    # The heuristic picked a pulled gather by the model and runs it as the
    # push all-gather (`heuristics.decide`): the model's pick's prediction
    # stands for it (the model has no family of its own for it).
    pick = cost_model.best(tuple(pr for pr in preds if pr.schedule != chosen),
                           min_gain=margin, allowed=eligible)
    preds = [pr for pr in preds if pr.schedule != chosen]
    preds.append(dataclasses.replace(pick, schedule=chosen))
    pushed = pick.schedule
  chosen_pred = next(pr for pr in preds if pr.schedule == chosen)
  return Explanation(
      op=op, x_shape=x_shape, w_shape=w_shape, dtype=np.dtype(dtype).name,
      axis_size=axis_size, axis=axis, device_kind=tgt.device_kind,
      params=params, chosen=chosen, source=source, reason=reason,
      transport=chosen.resolved_transport(
          spans_processes=jax.process_count() > 1, op=op),
      t_mm_s=none.t_mm, t_comm_s=none.t_comm,
      ideal_s=max(none.t_mm, none.t_comm), chosen_prediction=chosen_pred,
      candidates=tuple(
          Candidate(prediction=pr,
                    verdict=_why_lost(pr, chosen_pred, none, gated,
                                      eligible(pr.schedule), margin, pushed))
          for pr in sorted(preds, key=lambda pr: (
              not (eligible(pr.schedule) or pr.schedule == chosen), pr.total,
              pr.schedule != chosen))))
