"""One suite run's result files: JSON rewritten eagerly, markdown beside it.

The JSON is rewritten after every case (atomically), so a run killed by a
time limit or a hang keeps every finished number and names what it was doing
(``in_progress``). Only process 0 of a multi-process job writes.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any, Callable

from absl import flags

from lib import meta

FLAGS = flags.FLAGS
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


def out_dir(device_kind: str, axis_size: int, processes: int = 1) -> str:
  """``--out_dir``, or ``benchmarks/results/<device_slug>_w<W>[_p<N>]``
  (``_p<N>``: a job of N processes, kept apart from one process's)."""
  name = f"{meta.slug(device_kind)}_w{axis_size}"
  if processes > 1:
    name += f"_p{processes}"
  return FLAGS.out_dir or os.path.join(RESULTS_DIR, name)


def short_error(e: BaseException, limit: int = 1500) -> str:
  msg = f"{type(e).__name__}: {e}"
  if len(msg) > limit:
    msg = msg[: limit // 2] + " ... " + msg[-limit // 2:]
  return msg


def write_json(path: str, data: Any) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, default=str)
  os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


class Recorder:
  """Holds one suite run's results and rewrites ``<dir>/<name>.{json,md}``.

  Args:
    name: file stem (usually the suite's name).
    directory: where the files go.
    data: the initial JSON (``meta`` first; see `lib.meta.collect`).
    render: ``render(data) -> markdown``; None writes no markdown.
    writer: False in every process but process 0.
    agree: makes a flag the same in every process (multi-process jobs).
  """

  def __init__(self, name: str, directory: str, data: dict,
               render: Callable[[dict], str] | None, *, writer: bool = True,
               agree: Callable[[int], int] = lambda v: v):
    self.json_path = os.path.join(directory, f"{name}.json")
    self.md_path = os.path.join(directory, f"{name}.md")
    self.png_path = os.path.join(directory, f"{name}.png")
    self.data = data
    self.data.setdefault("in_progress", None)
    self.data.setdefault("skipped", [])
    self.render = render
    self.writer = writer
    self.agree = agree
    self.t0 = time.perf_counter()

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def over_budget(self) -> bool:
    over = FLAGS.time_budget_s > 0 and self.elapsed() > FLAGS.time_budget_s
    return bool(self.agree(int(over)))

  def progress(self, what: str | None) -> None:
    """Says (stdout) and records what runs now; saves."""
    self.data["in_progress"] = what
    if what and self.writer:
      print(f"[{self.elapsed():7.1f}s] {what}", flush=True)
    self.save()

  def skip(self, what: str, reason: str) -> None:
    self.data["skipped"].append({"what": what, "reason": reason})

  def save(self) -> None:
    if not self.writer:
      return
    self.data["elapsed_s"] = round(self.elapsed(), 2)
    write_json(self.json_path, self.data)
    if self.render is not None:
      try:
        text = self.render(self.data)
      except Exception as e:  # pylint: disable=broad-except
        # A report bug must not lose the measurements: the JSON is written.
        traceback.print_exc(limit=3)
        text = f"markdown failed: {short_error(e)}\n"
      write_text(self.md_path, text)

  def finish(self) -> None:
    self.progress(None)
    if self.writer:
      print(f"wrote {self.json_path}" + (f" and {self.md_path}" if self.render
                                          else ""), flush=True)


def guarded(rec: Recorder, label: str, fn: Callable[[], dict]) -> dict:
  """Runs one measurement; an exception becomes a recorded ``error``."""
  rec.progress(label)
  t0 = time.perf_counter()
  try:
    res = fn()
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc(limit=4)
    res = {"error": short_error(e)}
  res["wall_s"] = round(time.perf_counter() - t0, 3)
  return res
