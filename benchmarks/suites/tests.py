"""Suite ``tests``: the package's GPU test suite on this host, recorded.

Runs ``pytest -m <marker>`` (default ``"multigpu or gpu"``: every test that
runs on the local GPUs) over the repository's tests,
from a scratch folder so that the installed ficco_jax is the one tested, and
writes its summary (counts, failures, duration, command) to ``tests.json``
and ``tests.md`` in the host's results folder, for RESULTS.md. This process
never starts JAX's GPU backend, which would take GPU memory from the tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from absl import flags

from lib import meta as meta_lib
from lib import report
from lib import results

FLAGS = flags.FLAGS
flags.DEFINE_string("pytest_marker", "multigpu or gpu",
                    "tests: the pytest marker expression to run.")
flags.DEFINE_list("pytest_args", [],
                  "tests: extra pytest arguments (e.g. -x,--maxfail=5).")
flags.DEFINE_float("pytest_timeout_s", 0.0,
                   "tests: stop pytest after this many seconds (0: never).")

TESTS_DIR = os.path.join(meta_lib.REPO, "tests")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|"
                    r"xfailed|xpassed)")


_SECTION = re.compile(r"^=+ (.+?) =+$")
# A failure's header: underscores either side of the test id, down to one
# each where the id is long.
_HEADER = re.compile(r"^_+ (\S+) _+$")
# Progress lines of -q: one mark per test, then the percentage.
_PROGRESS = re.compile(r"^([.sFExX]+)\s*(\[\s*\d+%\])?$")
_MARKS = {".": "passed", "F": "failed", "s": "skipped", "E": "errors",
          "x": "xfailed", "X": "xpassed"}
# tests/test_soak.py's figures, printed with -rP.
_SOAK = re.compile(r"^(\w+): \d+ calls on \w+ in .*")


def summarize(log: str) -> dict:
  """Counts, the closing line, the failed test ids and the soak figures
  (when the log has the passed tests' output) of a pytest log."""
  lines = [l for l in log.splitlines() if l.strip()]
  closing = next((l.strip("= ") for l in reversed(lines)
                  if _COUNT.search(l) and " in " in l), None)
  counts = {}
  for n, what in _COUNT.findall(closing or ""):
    counts["errors" if what.startswith("error") else what] = int(n)
  if closing is None:
    # No summary (a time limit, or -qq): what the progress marks say ran,
    # so that a cut run still counts.
    for l in lines:
      m = _PROGRESS.match(l.strip())
      if m:
        for mark in m.group(1):
          counts[_MARKS[mark]] = counts.get(_MARKS[mark], 0) + 1
  failures = [l.split(" - ")[0] for l in lines
              if l.startswith(("FAILED ", "ERROR "))]
  # Without -rf (e.g. --pytest_args=-rsP) the short summary lists no
  # failure: take the FAILURES section's headers then.
  section = None
  for l in lines:
    if _SECTION.match(l):
      section = _SECTION.match(l).group(1)
    elif section == "FAILURES" and _HEADER.match(l):
      name = _HEADER.match(l).group(1)
      if not any(f.endswith(name) for f in failures):
        failures.append(f"FAILED {name}")
  soak = [l for l in lines if _SOAK.match(l)]
  return {"closing_line": closing, "counts": counts, "failures": failures,
          "soak": soak}


def markdown(data: dict) -> str:
  s = data["summary"]
  lines = ["# Tests", ""] + report.provenance(data["meta"])
  lines += [f"- pytest: `{data['pytest_command']}` (exit {data['returncode']},"
            f" {data['seconds']:.0f} s)", ""]
  if s["closing_line"]:
    cut = (f" (stopped at its {data['time_limit_s']:.0f} s limit)"
           if data.get("stopped_at_limit") else "")
    lines.append(f"**{s['closing_line']}{cut}**")
  else:
    marks = ", ".join(f"{n} {what}" for what, n in s["counts"].items())
    why = ("stopped before pytest's summary (time limit)"
           if data.get("stopped_at_limit") else
           "pytest printed no summary line (-qq?)")
    lines.append(f"**{why}; its progress marks: {marks or 'none'}**")
  if s["failures"]:
    lines += ["", "Failed:", ""] + [f"- `{f}`" for f in s["failures"]]
  if s.get("soak"):
    lines += ["", "Host memory over long runs (tests/test_soak.py, growth"
              " after the warm-up):", ""] + [f"- {l}" for l in s["soak"]]
  return "\n".join(lines) + "\n"


def run() -> int:
  gpus = meta_lib.gpu_count_without_jax()
  kind = meta_lib.gpu_name_without_jax() or "cpu"
  out = results.out_dir(kind, gpus or 1)
  info = meta_lib.collect("tests", devices=False)
  info.update(device_kind=kind, device_count=gpus or None)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-m", FLAGS.pytest_marker, *FLAGS.pytest_args, TESTS_DIR]
  shown = ["pytest", *cmd[3:-1], "tests"]  # As run from the repository.
  os.makedirs(out, exist_ok=True)
  log_path = os.path.join(out, "tests.log")
  start = time.monotonic()
  with tempfile.TemporaryDirectory() as scratch, open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=scratch, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # A time limit that still leaves the summary of what ran: pytest
    # prints it on an interrupt; a kill follows if it does not stop.
    killer = threading.Timer(30, proc.kill)
    stopped = threading.Event()
    def stop():
      stopped.set()
      proc.send_signal(signal.SIGINT)
      killer.start()
    timer = threading.Timer(FLAGS.pytest_timeout_s, stop)
    if FLAGS.pytest_timeout_s > 0:
      timer.start()
    captured = []
    for line in proc.stdout:  # Progress as it comes, and the whole log.
      sys.stdout.write(line)
      log.write(line)
      captured.append(line)
    rc = proc.wait()
    timer.cancel()
    if killer.is_alive():
      killer.cancel()
  data = {"meta": info, "pytest_command": " ".join(shown),
          "returncode": rc, "seconds": time.monotonic() - start,
          "time_limit_s": FLAGS.pytest_timeout_s,
          "stopped_at_limit": stopped.is_set(),
          "summary": summarize("".join(captured))}
  results.write_json(os.path.join(out, "tests.json"), data)
  results.write_text(os.path.join(out, "tests.md"), markdown(data))
  print(f"wrote {out}/tests.json: {data['summary']['closing_line']}",
        flush=True)
  return 0 if rc == 0 else 1
