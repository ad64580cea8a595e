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

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = os.path.join(os.path.dirname(HERE), "shapes.json")
OPS = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}

# The ten shapes every comparison so far was made on (per op): four models
# at 4096 and 8192 tokens, plus the two square cases.
PRESETS = {
    "ten": {"models": ["llama3-8b", "llama3-70b", "qwen2-72b", "gpt3-175b"],
            "tokens": [4096, 8192], "square": True},
}


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


def build(op: str, *, shapes_path: str = DEFAULT_SHAPES, models=(),
          tokens=(), square: bool = False, extra=(), tiny: bool = False
          ) -> list[Case]:
  """Cases of ``op`` ("ag" or "rs"), de-duplicated, in order: ``extra``
  ("[name:]MxKxN", named after a model or square case they match), then
  ``models`` ("all": every model) x ``tokens``, then the square cases.

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
