"""Benchmark cases: global (M, K, N) of one op, from shapes.json and flags.

For a model (H, F) of ``shapes.json``: the all-gather matmul ("ag") uses
K = H, N = F (the column-parallel first MLP matmul); the reduce-scatter
matmul ("rs") uses K = F, N = H (the row-parallel second one). M is the
token count. Square cases ``[M, K, N]`` are used as given. ``tiny`` divides
every dimension by 64 (rounded to a multiple of 32) for CPU smoke runs.

Framework-free: the torch worker builds its cases here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = os.path.join(os.path.dirname(HERE), "shapes.json")
HELDOUT = os.path.join(os.path.dirname(HERE), "data", "heldout_cases.json")
OPS = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}

# The ten shapes every comparison so far was made on (per op): four models
# at 4096 and 8192 tokens, plus the two square cases. "heldout": the drawn
# cases of HELDOUT, for scoring schedule=None where it was never tuned.
PRESETS = {
    "ten": {"models": ["llama3-8b", "llama3-70b", "qwen2-72b", "gpt3-175b"],
            "tokens": [4096, 8192], "square": True},
    "heldout": {"models": [], "tokens": [], "square": False,
                "heldout": True},
}

# Where held-out cases are drawn: (low, high, step), both ends included.
HELDOUT_RANGES = {"H": (2048, 16384, 256), "F": (4096, 57344, 256),
                  "tokens": (2048, 16384, 512)}
HELDOUT_SEED, HELDOUT_COUNT = 20261127, 24


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  m: int  # Global rows (tokens).
  k: int  # Contraction.
  n: int  # Output columns.

  @property
  def spec(self) -> str:
    return f"{self.m}x{self.k}x{self.n}"


def tiny_dim(d: int) -> int:
  return max(32, (d // 64) // 32 * 32)


def parse(item: str) -> Case:
  """``"MxKxN"`` or ``"name:MxKxN"`` (global sizes).

  Raises:
    ValueError: naming the item that is neither.
  """
  name, _, dims = item.rpartition(":")
  try:
    m, k, n = (int(d) for d in dims.lower().split("x"))
  except ValueError:
    raise ValueError(f"case {item!r}: expected [name:]MxKxN, e.g."
                     " llama3-8b/M4096:4096x4096x14336.") from None
  return Case(name=name or f"custom/{dims}", m=m, k=k, n=n)


def draw_heldout(seed: int = HELDOUT_SEED, count: int = HELDOUT_COUNT,
                 shapes_path: str = DEFAULT_SHAPES) -> list[dict]:
  """``count`` model shapes drawn at random (seeded) from HELDOUT_RANGES:
  width H, MLP width F and tokens, none with the (H, F) of a shapes.json
  model, so that nothing tuned or fitted on shapes.json has seen them."""
  with open(shapes_path) as f:
    models = json.load(f)["models"]
  taken = {(m["H"], m["F"]) for m in models.values()}
  rng = random.Random(seed)
  draw = lambda lo, hi, step: rng.randrange(lo, hi + 1, step)  # noqa: E731
  out, seen = [], set()
  while len(out) < count:
    h, f_, t = (draw(*HELDOUT_RANGES[k]) for k in ("H", "F", "tokens"))
    if (h, f_) in taken or (h, f_, t) in seen:
      continue
    seen.add((h, f_, t))
    out.append({"name": f"heldout-{len(out):02d}", "H": h, "F": f_,
                "tokens": t})
  return out


def write_heldout(path: str = HELDOUT, seed: int = HELDOUT_SEED,
                  count: int = HELDOUT_COUNT) -> None:
  """Saves `draw_heldout`'s cases with how they were drawn."""
  data = {"about": (
      "Held-out cases for scoring schedule=None on shapes nothing was"
      " tuned or fitted on: drawn once by"
      " benchmarks/lib/cases.py draw_heldout(seed, count), disjoint from"
      " shapes.json's models; never used to tune or fit. The all-gather"
      " runs M=tokens, K=H, N=F; the reduce-scatter M=tokens, K=F, N=H."),
      "seed": seed, "count": count, "ranges": HELDOUT_RANGES,
      "cases": draw_heldout(seed, count)}
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")


def heldout(op: str, path: str = HELDOUT) -> list[Case]:
  """The saved held-out cases of ``op`` ("ag" or "rs")."""
  with open(path) as f:
    drawn = json.load(f)["cases"]
  out = []
  for c in drawn:
    k, n = (c["H"], c["F"]) if op == "ag" else (c["F"], c["H"])
    out.append(Case(f"{c['name']}/M{c['tokens']}", c["tokens"], k, n))
  return out


def build(op: str, *, shapes_path: str = DEFAULT_SHAPES, models=(),
          tokens=(), square: bool = False, extra=(), tiny: bool = False,
          heldout_cases: bool = False) -> list[Case]:
  """Cases of ``op`` ("ag" or "rs"), de-duplicated, in order: ``extra``
  ("[name:]MxKxN", named after a model or square case they match), then
  ``models`` ("all": every model) x ``tokens``, then the square cases, then
  (``heldout_cases``) the saved held-out cases.

  Raises:
    ValueError: an unknown op or model, or a malformed case.
  """
  if op not in OPS:
    raise ValueError(f"op={op!r} must be one of {list(OPS)}.")
  with open(shapes_path) as f:
    shapes = json.load(f)
  all_models = shapes["models"]
  squares = [tuple(c) for c in shapes.get("square_cases", [])]
  names = list(all_models) if list(models) == ["all"] else list(models)
  scale = tiny_dim if tiny else (lambda d: d)

  def dims(model):
    h, f_ = all_models[model]["H"], all_models[model]["F"]
    return (h, f_) if op == "ag" else (f_, h)

  cases: list[Case] = []
  for item in extra:
    c = parse(item)
    if ":" not in item:
      for model in all_models:
        if (c.k, c.n) == dims(model):
          c = dataclasses.replace(c, name=f"{model}/M{c.m}")
      if (c.m, c.k, c.n) in squares or c.m == c.k == c.n:
        c = dataclasses.replace(c, name=f"square/{c.spec}")
    cases.append(c)
  for name in names:
    if name not in all_models:
      raise ValueError(
          f"Unknown model {name!r}; {shapes_path} has {list(all_models)}.")
    k, n = (scale(d) for d in dims(name))
    for m in (int(t) for t in tokens):
      cases.append(Case(f"{name}/M{m}", scale(m) if tiny else m, k, n))
  if square:
    for m, k, n in squares:
      cases.append(Case(f"square/{m}x{k}x{n}", *(scale(d) for d in (m, k, n))))
  if heldout_cases:
    cases += [dataclasses.replace(c, m=scale(c.m), k=scale(c.k),
                                  n=scale(c.n)) if tiny else c
              for c in heldout(op)]
  seen, out = set(), []
  for c in cases:
    if (c.m, c.k, c.n) not in seen:
      seen.add((c.m, c.k, c.n))
      out.append(c)
  return out


def local_shapes(op: str, case: Case, w: int):
  """Per-device (first operand, w) shapes inside shard_map at axis size W."""
  if op == "ag":
    return (case.m // w, case.k), (case.k, case.n // w)
  return (case.m, case.k // w), (case.k // w, case.n)


def divisible(op: str, case: Case, w: int) -> str | None:
  """Why ``case`` cannot be split over ``w`` devices, or None."""
  split = case.n if op == "ag" else case.k
  if case.m % w or split % w:
    return f"M={case.m} or {'N' if op == 'ag' else 'K'}={split} not divisible by W={w}"
  return None


if __name__ == "__main__":
  write_heldout()  # Re-draws benchmarks/data/heldout_cases.json.
