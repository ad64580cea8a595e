"""Runs a benchmark script and, if its copy-engine ops stall, says where.

Async issue (xla_ffi/PROTOCOL.md) lets a compute stream wait for a copy
that no thread has issued yet. A watchdog thread reads every copy queue's
flag (`library.flag_state`: the word, the last value assigned and the last
one issued) every few seconds. A stall is a queue whose word lags the
assigned value, with all the states unchanged for ``--stall_s``. Then it
writes the states, the live invocations and every Python thread's stack to
``--out`` and exits with status 3.

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


def _states(devices: int, queues: int):
  from ficco_jax._src.dma import library

  out = {}
  for d in range(devices):
    for q in range(queues):
      s = library.flag_state(d, q)
      if s is not None and s[1]:
        out[(d, q)] = s
  return out


def _watch(out_path: str, stall_s: float, period_s: float, devices: int,
           queues: int) -> None:
  from ficco_jax._src.dma import library

  last, since = None, time.monotonic()
  while True:
    time.sleep(period_s)
    try:
      states = _states(devices, queues)
    except Exception:  # pylint: disable=broad-except
      continue  # The library is not loaded yet.
    lagging = any(word != assigned for word, assigned, _ in states.values())
    if states != last or not lagging:
      last, since = states, time.monotonic()
      continue
    if time.monotonic() - since < stall_s:
      continue
    with open(out_path, "w") as f:
      f.write(f"stalled for {time.monotonic() - since:.0f} s\n")
      f.write("(device, queue): word, assigned, signalled\n")
      for key, s in sorted(states.items()):
        f.write(f"{key}: {s}\n")
      for platform in ("cuda",):
        f.write(f"live invocations: {library.live_invocations(platform)}, "
                f"pending entries: {library.pending_entries(platform)}\n")
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
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--queues", type=int, default=8)
  args = parser.parse_args(sys.argv[1:split])
  script = sys.argv[split + 1]
  threading.Thread(target=_watch, daemon=True,
                   args=(args.out, args.stall_s, args.period_s, args.devices,
                         args.queues)).start()
  sys.argv = [script] + sys.argv[split + 2:]
  sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
  runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
  main()
