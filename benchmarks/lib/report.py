"""Markdown pieces every suite's report uses."""

from __future__ import annotations

import math
import os
import re
from typing import Iterable, Sequence

from lib import meta as meta_lib

# The repository root, so that paths in reports can be shown relative to it.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def where_installed(path: str | None) -> str:
  """What a ``ficco_jax.__file__`` was, without the machine's paths."""
  if not path:
    return "unknown"
  if "site-packages" in path or "dist-packages" in path:
    return "installed"
  if path.startswith(REPO + os.sep):
    return "source tree"
  return "installed apart"


def shown_command(command: str | None) -> str:
  """A recorded command line as a reader would type it in the repository:
  the interpreter as ``python``, paths inside the repository relative to
  it, and ``--out_dir`` (where the files were first written) left out."""
  out = []
  for i, tok in enumerate((command or "").split(" ")):
    if tok.startswith("--out_dir="):
      continue
    if i == 0 and re.search(r"python[0-9.]*$", tok):
      tok = "python"
    out.append(tok.replace(REPO + os.sep, ""))
  return " ".join(out)


def num(v: float | None, digits: int = 3) -> str:
  return "-" if v is None else f"{v:.{digits}f}"


def times(d: dict | None) -> str:
  """``median (min)`` ms of a timing record; ``err`` / ``-`` without one."""
  if not d or d.get("median_ms") is None:
    return "err" if d and d.get("error") else "-"
  return f"{d['median_ms']:.3f} ({d['min_ms']:.3f})"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
  out = ["| " + " | ".join(header) + " |",
         "|" + "---|" * len(header)]
  out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return out


def _commit_line(meta: dict) -> str:
  """The commit that ran: where the run's checkout was edited after its
  HEAD (``+dirty``), the commit here whose files are the ones that ran
  (by git tree id), if there is one."""
  commit, tree = meta.get("git_commit"), meta.get("git_tree")
  if not (commit and commit.endswith("+dirty") and tree):
    return f"commit {commit}"
  found = meta_lib.commit_of_tree(tree)
  if found:
    return f"commit {found} (the files that ran; the run's HEAD was {commit})"
  return f"commit {commit}, tree {tree} (no commit here holds those files)"


def provenance(meta: dict) -> list[str]:
  """The lines that say where a table came from."""
  kind, count = meta.get("device_kind"), meta.get("device_count")
  dev = f"{count} x {kind}" if count else (kind or "none used")
  procs = meta.get("process_count")
  package = meta.get("package_commit")
  lines = [f"- device: {dev}" + (f", {procs} processes" if procs and procs > 1
                                 else ""),
           f"- jax {meta.get('jax')}, ficco_jax {meta.get('ficco_jax')}"
           f" ({where_installed(meta.get('ficco_jax_file'))}"
           + (f", {package}" if package else "") + "), "
           + _commit_line(meta) + f", {meta.get('date')}",
           f"- command: `{shown_command(meta.get('command'))}`"]
  env = meta.get("env") or {}
  if env:
    lines.append("- env: " + ", ".join(f"`{k}={v}`" for k, v in env.items()))
  return lines


def geomean(values: Sequence[float]) -> float | None:
  vals = [v for v in values if v and v > 0]
  return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def skipped(data: dict) -> list[str]:
  items = data.get("skipped") or []
  if not items:
    return []
  return ["", "Skipped:"] + [f"- {s.get('what')}: {s.get('reason')}"
                             for s in items]


def demote(markdown: str, levels: int) -> str:
  """Every heading ``levels`` deeper (to nest a suite's report); lines in
  fenced code blocks are left alone."""
  out, fenced = [], False
  for line in markdown.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    heading = line.startswith("#") and not fenced
    out.append("#" * levels + line if heading else line)
  return "\n".join(out)
