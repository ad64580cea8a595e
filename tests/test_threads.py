"""Several host threads dispatching copy-engine programs that share devices
(docs/protocol.md, "Several dispatching threads").

That is unsupported: XLA may run the programs in different orders on
different devices, and then a rank waits for a peer whose part runs after
another program's. What must hold is that it ends: every call returns its
right result or fails with the error that says to dispatch from one thread,
within a bound, and calls dispatched afterwards from one thread work.

The threads run in a process of their own (threads_worker.py), on 2
virtual CPU devices as in the issue: XLA:CPU's launch order depends on the
device count, and a hang stays in that process, which the test kills.
"""

import json
import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "threads_worker.py")
CALLS = 300
# Calls in flight per thread. Two threads past XLA:CPU's in-flight limit
# per device (32) make its launches diverge across devices; each stall took
# its whole timeout before the fix, call after call (tens of seconds here).
# Unbounded, XLA:CPU hangs by itself past ~100 calls in flight per device,
# with no copy-engine op in the programs, which no handler can end.
DEPTH = 24
TIMEOUT_S = 2.0
QUIET_S = 1.5  # stall_breaker.h's kQuiet, and a margin.
# One stall's timeout, the calls queued behind it failing at once, the
# interpreter's start and the compiles.
BOUND_S = 60.0


def test_two_threads_end_with_right_results_or_the_clear_error():
  cmd = [sys.executable, WORKER, str(CALLS), str(DEPTH), str(TIMEOUT_S),
         str(QUIET_S)]
  try:
    run = subprocess.run(cmd, capture_output=True, text=True,
                         timeout=BOUND_S, env=dict(os.environ, XLA_FLAGS=""))
  except subprocess.TimeoutExpired as e:
    raise AssertionError(
        f"two dispatching threads still running after {BOUND_S} s:"
        f" {(e.stderr or b'')[-2000:]!r}") from None
  assert run.returncode == 0, run.stderr[-4000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  for name, counts in result["report"].items():
    assert counts["right"] + counts["clear"] == CALLS, (name, counts)
  assert result["elapsed"] < BOUND_S / 2, result
  assert result["after"] == ["right", "right"], result
