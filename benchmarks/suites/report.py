"""Suite ``report``: regenerates benchmarks/RESULTS.md from the result files.

One section per folder of ``--results_dir`` (``<device_slug>_w<W>``: one
device kind and GPU count), each suite's tables re-rendered from its JSON by
the suite's own report code, under the command, device, versions and date
its JSON records. Folders named in ``--expect`` with no results get a
"not yet measured" line.
"""

from __future__ import annotations

import glob
import json
import os
import re

from absl import flags

from lib import report
from lib import results
from suites import autotune
from suites import compare
from suites import heuristic_report
from suites import host_floor
from suites import kernel
from suites import moe
from suites import ops_report
from suites import peers
from suites import profile
from suites import step
from suites import tests

FLAGS = flags.FLAGS
flags.DEFINE_string("results_dir", results.RESULTS_DIR,
                    "report: the folder of <device_slug>_w<W> folders.")
flags.DEFINE_string("report_out",
                    os.path.join(results.BENCH_DIR, "RESULTS.md"),
                    "report: the markdown file to write.")
flags.DEFINE_list("expect", ["nvidia_h200_w2", "nvidia_h200_w4"],
                  "report: folders that get a section even when empty.")

COMMAND = "python benchmarks/bench.py --suite=report"


def _characterize_md(data: dict) -> str:
  counts = {k: len(data.get(k, [])) for k in ("decomposition", "contention",
                                                "copy")}
  lines = (["# Characterization", ""] + report.provenance(data["meta"])
           + ["", f"Measurements per section: {counts}; fitted"
              " parameters in device_params.json beside it."])
  summary = data.get("contention_summary") or []
  if summary:
    lines += ["", "Matmul against the copies (`hidden`: the share of the"
              " shorter of the two that running them together hid; one"
              " `copies ms` per engine and size for every matmul):", "",
              "| matmul | compute | engine | MiB/peer | matmul ms | copies ms"
              " | both ms | hidden |", "|---|---|---|---|---|---|---|---|"]
    for r in summary:
      lines.append(
          f"| {'x'.join(map(str, r['mm']))} | {r['compute']} | {r['engine']}"
          f" | {r['mib_per_peer']:g} | {r['mm_ms']:.3f} | {r['copy_ms']:.3f}"
          f" | {r['both_ms']:.3f} | {r['hidden']:.2f} |")
  return "\n".join(lines) + "\n"


def _renderers(folder: str):
  """(file stem, markdown renderer) in report order."""
  peers_data = ops_report.load_peers(os.path.join(folder, "peers.json"))
  return [
      ("tests", tests.markdown),
      ("ops", lambda d: ops_report.markdown(d, peers_data)),
      ("compare", compare.markdown),
      ("peers", peers.markdown),
      ("step", step.markdown),
      ("moe", moe.markdown),
      ("moe_train", moe.markdown),
      ("host_floor", host_floor.markdown),
      ("kernel_chunks", kernel.markdown),
      ("kernel_pieces", kernel.markdown),
      ("kernel_grouped", kernel.markdown),
      ("kernel_grouped_dw", kernel.markdown),
      ("characterize", _characterize_md),
      ("heuristic", heuristic_report.markdown),
      ("autotune", autotune.markdown),
      ("profile", profile.markdown),
  ]


def _device_kind(folder: str) -> str | None:
  """The device kind the measurements of ``folder`` ran on, if any (files
  that ran on no device, such as the heuristic's, only name their labels')."""
  kinds = []
  for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    try:
      with open(path) as f:
        meta = json.load(f).get("meta", {})
    except (OSError, ValueError, AttributeError):
      continue
    if meta.get("device_kind"):
      kinds.append((not meta.get("device_count"), meta["device_kind"]))
  return min(kinds)[1] if kinds else None


def section(folder: str) -> list[str]:
  """The markdown of one results folder (one device kind and GPU count),
  then of its subfolders (re-checks of some cases, e.g. a before/after
  comparison repeated where the first one flagged a case)."""
  out = []
  for stem, render in _renderers(folder):
    path = os.path.join(folder, f"{stem}.json")
    if not os.path.exists(path):
      continue
    try:
      with open(path) as f:
        out += ["", report.demote(render(json.load(f)), 2).rstrip()]
    except Exception as e:  # pylint: disable=broad-except
      out += ["", f"### {stem}", "", f"Unreadable: {results.short_error(e)}"]
  for sub in sorted(glob.glob(os.path.join(folder, "*", ""))):
    body = section(sub.rstrip(os.sep))
    if body:
      out += ["", f"### Re-check: `{os.path.basename(sub.rstrip(os.sep))}`"]
      out += [report.demote(chunk, 1) for chunk in body]
  return out


def markdown(results_dir: str, expect) -> str:
  folders = sorted(d for d in glob.glob(os.path.join(results_dir, "*"))
                   if os.path.isdir(d))
  names = sorted({os.path.basename(d) for d in folders} | set(expect))
  lines = [
      "# Benchmark results", "",
      "Generated by `" + COMMAND + "` from the result files under"
      " `benchmarks/results/<device>_w<GPUs>/`; every table says the command"
      " that measured it, the device, the jax version and the date."
      " benchmarks/README.md describes the suites, the timing method and"
      " \"XLA at its best\"."]
  for name in names:
    folder = os.path.join(results_dir, name)
    parts = re.fullmatch(r"(.+)_w(\d+)(?:_p(\d+))?", name)
    title = _device_kind(folder) or (
        parts.group(1).replace("_", " ").upper() if parts else name)
    if parts:
      title += f", {parts.group(2)} GPU(s)"
      if parts.group(3):
        title += f", {parts.group(3)} processes"
    lines += ["", f"## {title}"]
    body = section(folder)
    lines += body or ["", "Not yet measured with this command."]
  return "\n".join(lines) + "\n"


def run() -> int:
  results.write_text(FLAGS.report_out, markdown(FLAGS.results_dir,
                                                FLAGS.expect))
  print(f"wrote {FLAGS.report_out}", flush=True)
  return 0
