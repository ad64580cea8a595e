"""Runs a benchmark script and, if its copy-engine ops stop making progress,
says where.

Every host wait of the peer-copy protocol is bounded, so a stall that no
timeout reports is on the devices or inside a driver call. A watchdog
thread reads the handlers' call counts (`library.host_stats`) every few
seconds. A stall is live invocations with the counts unchanged for
``--stall_s``. Then it writes the counts, the live invocations and every
Python thread's stack to ``--out`` and exits with status 3 (C++ stacks: run
it under ``gdb -batch -ex 'thread apply all bt'`` or py-spy where one is
installed).

  python benchmarks/stall_watch.py --out=stall.txt -- benchmarks/rs_bench.py ...
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import runpy
import sys
import threading
import time


def _state(platform: str):
  from ficco_jax._src.dma import library

  calls = {k: c for k, (c, _) in library.host_stats(platform).items()}
  return calls, library.live_invocations(platform)


def _watch(out_path: str, stall_s: float, period_s: float,
           platform: str) -> None:
  last, since = None, time.monotonic()
  while True:
    time.sleep(period_s)
    try:
      state = _state(platform)
    except Exception:  # pylint: disable=broad-except
      continue  # The library is not loaded yet.
    if state != last or state[1] == 0:
      last, since = state, time.monotonic()
      continue
    if time.monotonic() - since < stall_s:
      continue
    from ficco_jax._src.dma import library

    with open(out_path, "w") as f:
      f.write(f"stalled for {time.monotonic() - since:.0f} s\n")
      f.write(f"handler calls: {state[0]}\n")
      f.write(f"live invocations: {state[1]}, pending entries: "
              f"{library.pending_entries(platform)}\n")
      f.flush()
      faulthandler.dump_traceback(file=f, all_threads=True)
    print(f"stall_watch: stalled; see {out_path}", flush=True)
    os._exit(3)


def main() -> None:
  if "--" not in sys.argv:
    raise SystemExit(__doc__)
  split = sys.argv.index("--")
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="stall.txt")
  parser.add_argument("--stall_s", type=float, default=45.0)
  parser.add_argument("--period_s", type=float, default=5.0)
  parser.add_argument("--platform", default="cuda")
  args = parser.parse_args(sys.argv[1:split])
  script = sys.argv[split + 1]
  threading.Thread(target=_watch, daemon=True,
                   args=(args.out, args.stall_s, args.period_s,
                         args.platform)).start()
  sys.argv = [script] + sys.argv[split + 2:]
  sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
  runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
  main()
