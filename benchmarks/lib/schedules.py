"""``--schedules`` labels -> ficco_jax schedules, through the public API only.

Items, comma separated:

* ``default``: ``schedule=None``, the library's own choice;
* ``none``: no overlap (XLA's collective, then one dot, inside ficco);
* a label as ``Schedule.short()`` prints it, read by ``Schedule.from_short``:
  ``dataflow/cN[/comm[/compute[/...]]]``, e.g. ``direct/c2/dma``;
* presets: ``quick`` (default; direct c1/c2/c4, ring c1, bidirectional c1/c2
  on the copy engines; direct c2 and ring c1 on ppermute), ``all`` (every
  dataflow x chunks 1/2/4 x engine, plus none) and ``tuning`` (default,
  none, and the copy-engine schedules the shipped caches ever chose: direct
  c1/c2/c4, ring c1, bidirectional c1 on XLA's dots, direct c1/c2 on
  ficco's Pallas kernel, direct c2 Pallas step, and each op's flagged
  granularity: the reduce-scatter's kernel-signalled pieces, the push
  all-gather; each op skips the other's, `applies`).
"""

from __future__ import annotations

from typing import Any

DEFAULT = "default"


def _quick(Schedule):
  out = [DEFAULT]
  for df, c in (("direct", 1), ("direct", 2), ("direct", 4), ("ring", 1),
                ("bidirectional", 1), ("bidirectional", 2)):
    out.append(Schedule(dataflow=df, num_chunks=c, comm="dma"))
  for df, c in (("direct", 2), ("ring", 1)):
    out.append(Schedule(dataflow=df, num_chunks=c, comm="xla"))
  return out


def _all(Schedule):
  out = [DEFAULT]
  for comm in ("dma", "xla"):
    for df in ("direct", "ring", "bidirectional"):
      for c in (1, 2, 4):
        out.append(Schedule(dataflow=df, num_chunks=c, comm=comm))
  return out + [Schedule(dataflow="none")]


def _tuning(Schedule):
  out = [DEFAULT, Schedule(dataflow="none")]
  for df, c in (("direct", 1), ("direct", 2), ("direct", 4), ("ring", 1),
                ("bidirectional", 1)):
    out.append(Schedule(dataflow=df, num_chunks=c, comm="dma"))
  for c in (1, 2):
    out.append(Schedule(dataflow="direct", num_chunks=c, comm="dma",
                        compute="pallas"))
  out.append(Schedule(dataflow="direct", num_chunks=2, comm="dma",
                      compute="pallas", compute_granularity="step"))
  out.append(Schedule(dataflow="direct", num_chunks=1, comm="dma",
                      compute="pallas", compute_granularity="flagged"))
  out.append(Schedule(dataflow="direct", num_chunks=1, comm="dma",
                      compute_granularity="flagged"))
  return out


def applies(op_key: str, sched: Any) -> str | None:
  """Why ``sched`` is not a schedule of op ``op_key`` ("ag" or "rs"), or
  None: "halving" is the reduce-scatter's, and the reduce-scatter's
  "flagged" needs its kernel (the all-gather's runs on either: the push
  all-gather on XLA's BLAS, the signalled all-gather on the kernel)."""
  if sched is None:
    return None
  g = sched.compute_granularity
  if op_key == "ag" and g == "halving":
    return "a reduce-scatter granularity"
  if g == "flagged" and op_key == "rs" and sched.compute != "pallas":
    return "the all-gather's push granularity"
  return None


PRESETS = {"quick": _quick, "all": _all, "tuning": _tuning}


def parse(items: list[str]) -> list[tuple[str, Any]]:
  """(label, Schedule or None) pairs, de-duplicated, in order.

  Raises:
    ValueError: an item that is no preset and no schedule label.
  """
  from ficco_jax import Schedule

  out: list[tuple[str, Any]] = []

  def add(sched):
    label = DEFAULT if sched == DEFAULT else sched.short()
    if label not in [l for l, _ in out]:
      out.append((label, None if sched == DEFAULT else sched))

  for item in (i.strip() for i in items if i.strip()):
    if item == DEFAULT:
      add(DEFAULT)
    elif item == "none":
      add(Schedule(dataflow="none"))
    elif item in PRESETS:
      for s in PRESETS[item](Schedule):
        add(s)
    else:
      add(Schedule.from_short(item))
  return out
