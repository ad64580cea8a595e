"""The one benchmark command: ``python benchmarks/bench.py --suite=NAME [flags]``.

Run it as a script path (not ``python -m``), so that ``import ficco_jax``
finds the installed package rather than the source tree. Suites (one module
each under suites/; benchmarks/README.md describes them):

  ops          both collective matmuls vs XLA (and XLA at its best)
  compare      two ops results side by side (before/after regression check)
  step         a tensor-parallel block's training step, ficco vs XLA
  kernel       the Pallas chunk kernel vs XLA's dot on one GPU
  host-floor   a tiny op, XLA vs ficco, with the copy handlers' host counters
  peers        PyTorch async-TP under torchrun, same cases and method
  moe          the MoE layer (dispatch, experts, combine) vs XLA's ragged ops
  characterize device components; fits the device parameters
  heuristic    schedule=None's picks scored against measured labels
  autotune     fills an autotune cache from measured labels
  profile      JAX profiler traces of chosen programs, summarized
  report       regenerates benchmarks/RESULTS.md from benchmarks/results/
  tests        the GPU test suite (pytest -m multigpu) on this host, recorded

``python benchmarks/bench.py --helpfull`` lists every flag.
"""

from __future__ import annotations

import importlib
import sys

from absl import app
from absl import flags

from lib import multiprocess
from lib import options  # noqa: F401  (defines the shared flags)

SUITES = {
    "ops": "suites.ops",
    "compare": "suites.compare",
    "step": "suites.step",
    "kernel": "suites.kernel",
    "host-floor": "suites.host_floor",
    "peers": "suites.peers",
    "moe": "suites.moe",
    "characterize": "suites.characterize",
    "heuristic": "suites.heuristic",
    "autotune": "suites.autotune",
    "profile": "suites.profile",
    "report": "suites.report",
    "tests": "suites.tests",
}
# Every suite's flags exist before parsing (imports are light: no JAX).
MODULES = {name: importlib.import_module(path) for name, path in SUITES.items()}

flags.DEFINE_enum("suite", None, list(SUITES), "The suite to run.")
flags.mark_flag_as_required("suite")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  multiprocess.init_if_child()  # Before anything starts a JAX backend.
  sys.exit(MODULES[flags.FLAGS.suite].run())


if __name__ == "__main__":
  app.run(main)
