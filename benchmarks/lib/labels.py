"""Measured labels: per case, the time of every schedule timed in one run.

Reads ops-suite results (``{"ops": {"ag"|"rs": {"cases": [...]}}}``), the
older one-op result files kept under benchmarks/data/ (``cases`` with
``baselines.xla`` and ``methods`` of ``{"method": "ficco", "label",
"median_ms", "min_ms"}``), and the minimal form ``{"op": ..., "cases":
[{"name", "M", "K", "N", "axis_size", "schedules": {label: ms}}]}``. A file
given as ``PATH:MEMBER`` is member ``MEMBER`` of a bundle (a JSON object of
result files). M, K, N are global; the local shapes follow the op
(lib/cases.py). Each (file, case) is one labelled case; the file is its run.
"""

from __future__ import annotations

import dataclasses
import os

from lib import cases as cases_lib
from lib import internal

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH_DIR)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  name: str
  op: str
  m: int
  k: int
  n: int
  p: int
  times: tuple = ()  # ((Schedule, ms), ...)
  run: str = ""
  # XLA's collective + dot as the harness's baseline, when the case also
  # timed dataflow "none" (the same program) explicitly. The labels keep one
  # timing per schedule ("none"'s own), so no schedule gets two draws; the
  # autotune rule uses the faster of the two, to stay on XLA's program where
  # a win is doubtful.
  xla_ms: float | None = None

  @property
  def model(self) -> str:
    return self.name.split("/")[0]

  @property
  def label(self) -> str:
    short = {v: k for k, v in cases_lib.OPS.items()}
    return " ".join(x for x in (self.run, short.get(self.op, self.op),
                                self.name) if x)

  def local(self):
    """(first operand, w) local shapes inside shard_map."""
    key = {v: k for k, v in cases_lib.OPS.items()}[self.op]
    return cases_lib.local_shapes(
        key, cases_lib.Case(self.name, self.m, self.k, self.n), self.p)

  def problem(self):
    x, w = self.local()
    return internal.tuning("cost_model").problem(
        self.op, x_shape=x, w_shape=w, dtype="bfloat16", axis_size=self.p)


def parse_label(label: str):
  """The Schedule of a ``dataflow/cN/comm/compute[/...]`` label, else None
  ("default", Mosaic configs, ...)."""
  parts = label.split()[0].split("/") if label.strip() else []
  if len(parts) < 4 or not parts[1].startswith("c"):
    return None
  try:
    from ficco_jax import Schedule  # pylint: disable=g-import-not-at-top
    return Schedule.from_short(label.split()[0])
  except (ValueError, TypeError):
    return None


def read(spec: str) -> tuple[dict, str]:
  """(JSON of ``PATH`` or of member ``MEMBER`` of ``PATH:MEMBER``, run tag).

  Relative paths are tried from the working directory, then the repository
  root. The run tag is the file's folder and stem (and member).
  """
  import json
  path, _, member = spec.partition(":")
  if not os.path.isabs(path) and not os.path.exists(path):
    path = os.path.join(REPO, path)
  with open(path) as f:
    data = json.load(f)
  if member:
    data = data[member]
  folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
  stem = os.path.splitext(os.path.basename(path))[0]
  return data, f"{folder}/{stem}" + (f":{member}" if member else "")


def _tables(data: dict):
  """(op name, cases, XLA baseline getter) of a result file."""
  if "ops" in data:  # The ops suite.
    for key, op in data["ops"].items():
      yield (cases_lib.OPS[key], op["cases"],
             lambda c: c.get("xla", {}).get("shard_map", {}))
    return
  meta = data.get("meta", {})
  op = data.get("op") or meta.get("op") or "all_gather_matmul"
  yield (cases_lib.OPS.get(op, op), data.get("cases", []),
         lambda c: c.get("baselines", {}).get("xla", {}))


def load(paths, duplicates: list | None = None, stat: str = "min_ms"):
  """Cases with at least two measured schedules, and the device kind.

  Each schedule's time is its ``stat`` (``"median_ms"`` or ``"min_ms"``).
  A ``"default"`` method (schedule=None) counts as a measurement of the
  schedule it resolved to when the case has no explicit one; otherwise the
  pair goes to ``duplicates`` as ``(case label, schedule, explicit ms,
  default ms)``: the same program timed twice in one run. Wrong results
  (``ok`` false) are never labels.
  """
  from ficco_jax import Schedule  # pylint: disable=g-import-not-at-top
  none = Schedule(dataflow="none")
  cases, kind = [], None
  for spec in paths:
    data, run = read(spec)
    kind = kind or data.get("meta", {}).get("device_kind")
    for op, table, xla_of in _tables(data):
      for c in table:
        times, defaults = {}, {}
        for label, ms in c.get("schedules", {}).items():
          s = parse_label(label)
          if s and ms:
            times[s] = float(ms)
        for mth in c.get("methods", []):
          if (mth.get("method") != "ficco" or not mth.get(stat)
              or mth.get("ok", True) is False):
            continue
          s = parse_label(mth.get("label", ""))
          if s:
            times[s] = float(mth[stat])
          elif mth.get("label") == "default":
            s = parse_label(mth.get("resolved") or "")
            if s:
              defaults[s] = float(mth[stat])
        xla = xla_of(c).get(stat)
        explicit_none = none in times
        if xla and not explicit_none:
          # XLA's collective + dot in shard_map is exactly dataflow "none".
          times[none] = float(xla)
        case = Case(name=c.get("name", "?"), op=op, m=int(c["M"]),
                    k=int(c["K"]), n=int(c["N"]),
                    p=int(c.get("W", c.get("axis_size", 0))), run=run,
                    xla_ms=float(xla) if xla and explicit_none else None)
        for s, ms in defaults.items():
          if s in times:
            if duplicates is not None:
              duplicates.append((case.label, s.short(), times[s], ms))
          else:
            times[s] = ms
        if len(times) >= 2:
          cases.append(dataclasses.replace(case, times=tuple(times.items())))
  return cases, kind


def keep_latest(cases: list[Case]) -> list[Case]:
  """Of the runs of one (op, shape, axis size), only the last input's."""
  last = {}
  for c in cases:
    last[(c.op, c.name, c.m, c.k, c.n, c.p)] = c.run
  return [c for c in cases
          if c.run == last[(c.op, c.name, c.m, c.k, c.n, c.p)]]
