"""The one timing method every suite uses.

Compile and warm up (3 calls, the first compiles), then R rounds of N
back-to-back calls with a single block at the end of each round. A round's
time divided by N is one sample of the per-call time; we report the median
and the minimum over the rounds. Dispatch is asynchronous, so N back-to-back
calls keep the device busy and launch gaps stay out of the numbers, while the
block at the end of a round makes every round include all of its work.

Inputs rotate among several sets so that repeated calls do not measure a
cache that holds the previous call's operands. They must be random: zeros
can run faster.

Short ops get more calls per round (`set_min_round_ms`): host jitter of a
few milliseconds (a late dispatch, the copy-engine handlers' rendezvous)
moves a 6 ms round by tens of percent, so after the warm-up the per-call
time is estimated from one timed batch of ``iters`` calls and the calls per
round raised until a round lasts at least ``min_round_ms`` (at most
`MAX_ITERS`). The result's ``iters`` says how many ran.

Interleaved mode (`interleaved`): the candidates of one case are compiled,
warmed up and registered first, then timed round-robin (round r runs every
candidate once), so slow drift of the machine (clocks, temperature, a
neighbour) spreads over all candidates instead of landing on whichever ran
last. What precedes a timed block matters on a GPU near its power limit (the
same executable registered twice read up to 9% apart, the copy that always
followed a light program being the faster), so:

* each round runs the candidates in a fresh random order, seeded by the
  round so runs are repeatable (``order="rotate"`` keeps one cyclic order
  and only rotates its start);
* each timed block is preceded by untimed calls of the same program for at
  least ``settle_ms`` (at least one call), so every program is timed in the
  state its own work leaves the device in, not its predecessor's;
* light programs that nothing is compared with (the matmul alone, the
  collective alone) are timed at once, outside the round-robin
  (``time_jax(..., interleave=False)``).

With several processes (one JAX job over many hosts or GPUs), every process
must issue the same calls: the calls per round are agreed through
`set_agree` (process 0's estimate wins).

This module imports no framework at import time, so the torch worker can use
`summarize` and `time_torch` without pulling JAX in.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from typing import Any, Callable, Sequence

WARMUP = 3
ROUNDS = 5
ITERS = 20
MAX_ITERS = 2000
ORDERS = ("shuffle", "rotate")

_min_round_ms = 0.0
_settle_ms = 10.0
_order = "shuffle"
_agree: Callable[[int], int] = lambda n: n  # noqa: E731


def set_min_round_ms(ms: float) -> None:
  """Rounds of `time_jax` last at least ``ms`` (0: exactly ``iters`` calls)."""
  global _min_round_ms
  if ms < 0:
    raise ValueError(f"min_round_ms={ms} must be >= 0.")
  _min_round_ms = float(ms)


def set_settle_ms(ms: float) -> None:
  """Interleaved blocks follow untimed calls of their program for ``ms``."""
  global _settle_ms
  if ms < 0:
    raise ValueError(f"settle_ms={ms} must be >= 0.")
  _settle_ms = float(ms)


def set_order(order: str) -> None:
  """Round order of interleaved timing: ``"shuffle"`` or ``"rotate"``."""
  global _order
  if order not in ORDERS:
    raise ValueError(f"order={order!r} must be one of {ORDERS}.")
  _order = order


def set_agree(fn: Callable[[int], int]) -> None:
  """``fn(n)`` returns the value every process uses (multi-process jobs)."""
  global _agree
  _agree = fn


def settings() -> dict[str, Any]:
  """The module's current timing settings, for result files."""
  return {"min_round_ms": _min_round_ms, "settle_ms": _settle_ms,
          "order": _order}


def round_order(n: int, r: int) -> list[int]:
  """Indices of ``n`` interleaved candidates in the order round ``r`` runs them."""
  if _order == "rotate":
    return [(j + r) % n for j in range(n)]
  order = list(range(n))
  random.Random(r).shuffle(order)
  return order


def iters_for(per_call_ms: float, iters: int, min_round_ms: float) -> int:
  """Calls per round: ``iters``, raised so a round lasts ``min_round_ms``."""
  if min_round_ms <= 0 or per_call_ms <= 0:
    return iters
  need = int(-(-min_round_ms // per_call_ms))  # ceil
  return max(iters, min(need, MAX_ITERS))


def summarize(per_call_ms: Sequence[float], *, iters: int) -> dict[str, Any]:
  """Median and min over rounds of a list of per-call times (ms)."""
  samples = [float(t) for t in per_call_ms]
  return {
      "median_ms": statistics.median(samples),
      "min_ms": min(samples),
      "rounds_ms": samples,
      "rounds": len(samples),
      "iters": iters,
  }


def time_jax(
    fn: Callable[..., Any],
    arg_sets: Sequence[Sequence[Any]],
    *,
    warmup: int = WARMUP,
    rounds: int = ROUNDS,
    iters: int = ITERS,
    interleave: bool = True,
) -> dict[str, Any]:
  """Times a jitted (or compiled) JAX function.

  Args:
    fn: a `jax.jit`-compiled callable (compilation happens in the first
      warm-up call and is timed as ``compile_and_first_call_s``).
    arg_sets: one or more argument tuples; calls cycle through them.
    warmup: calls before timing (at least 1, which also compiles).
    rounds: timed rounds.
    iters: back-to-back calls per round (raised by ``min_round_ms``).
    interleave: False times ``fn`` now even inside `interleaved` (for light
      reference programs that nothing is compared with).

  Returns:
    ``{"median_ms", "min_ms", "rounds_ms", "rounds", "iters",
    "compile_and_first_call_s"}``; times are per call. Inside `interleaved`
    only ``compile_and_first_call_s``, ``interleaved`` and ``settle_calls``
    until the block exits, which fills in the rest of this same dict (so
    callers must keep it, not copy it).
  """
  import jax  # Lazy: keep this module framework-free at import time.

  if not arg_sets:
    raise ValueError("arg_sets must hold at least one argument tuple.")
  t0 = time.perf_counter()
  out = fn(*arg_sets[0])
  jax.block_until_ready(out)
  first_s = time.perf_counter() - t0
  for i in range(1, max(1, warmup)):
    out = fn(*arg_sets[i % len(arg_sets)])
  jax.block_until_ready(out)
  del out
  per_call_ms = 0.0
  pending = _pending is not None and interleave
  if _min_round_ms > 0 or pending:
    # One timed batch of `iters` calls estimates the per-call time.
    per_call_ms = _batch_ms(fn, arg_sets, iters, 0)
    iters = _agree(iters_for(per_call_ms, iters, _min_round_ms))
  if pending:
    res = {"compile_and_first_call_s": first_s, "interleaved": True,
           "settle_calls": _agree(iters_for(per_call_ms, 1, _settle_ms))}
    _pending.append((fn, arg_sets, rounds, iters, res))
    return res
  per_call = [_batch_ms(fn, arg_sets, iters, r * iters) for r in range(rounds)]
  res = summarize(per_call, iters=iters)
  res["compile_and_first_call_s"] = first_s
  return res


def time_chain(step: Callable[..., Any], state: Any,
               arg_sets: Sequence[Sequence[Any]], *, warmup: int = WARMUP,
               rounds: int = ROUNDS, iters: int = ITERS
               ) -> tuple[Any, dict[str, Any]]:
  """Times ``state = step(state, *args)``: the same method for programs
  that thread (and donate) their state, such as a training step or a
  kernel writing into its own output. Never interleaved.

  Returns:
    (the final state, the same record as `time_jax`).
  """
  import jax  # Lazy, see the module docstring.

  t0 = time.perf_counter()
  state = step(state, *arg_sets[0])
  jax.block_until_ready(state)
  first_s = time.perf_counter() - t0
  k = 1
  for _ in range(max(0, warmup - 1)):
    state = step(state, *arg_sets[k % len(arg_sets)])
    k += 1
  jax.block_until_ready(state)
  per_call = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(iters):
      state = step(state, *arg_sets[k % len(arg_sets)])
      k += 1
    # Each device runs its calls in order: the last result ready means all.
    jax.block_until_ready(state)
    per_call.append((time.perf_counter() - t0) * 1e3 / iters)
  res = summarize(per_call, iters=iters)
  res["compile_and_first_call_s"] = first_s
  return state, res


def time_chains(chains: Sequence[tuple[Callable[..., Any], Any]],
                arg_sets: Sequence[Sequence[Any]], *, warmup: int = WARMUP,
                rounds: int = ROUNDS, iters: int = ITERS
                ) -> tuple[list[Any], list[dict[str, Any]]]:
  """`time_chain` for several programs at once, interleaved: each round
  runs ``iters`` calls of every chain ``(step, state)``, in the order
  `round_order` gives that round, each block after one untimed call of its
  own program (the previous block ran another). Every chain sees the
  device in the same states over the run (its clocks, its heat), which
  back-to-back runs of one program after another do not.

  Returns:
    (the final states, one `time_chain` record per chain).
  """
  import jax  # Lazy, see the module docstring.

  steps = [c[0] for c in chains]
  states = [c[1] for c in chains]
  calls = [0] * len(chains)

  def run(i, n):
    for _ in range(n):
      states[i] = steps[i](states[i], *arg_sets[calls[i] % len(arg_sets)])
      calls[i] += 1
    jax.block_until_ready(states[i])

  for i in range(len(chains)):
    run(i, max(1, warmup))
  samples: list[list[float]] = [[] for _ in chains]
  for r in range(rounds):
    for i in round_order(len(chains), r):
      run(i, 1)  # Settle: the previous block ran another program.
      t0 = time.perf_counter()
      run(i, iters)
      samples[i].append((time.perf_counter() - t0) * 1e3 / iters)
  return states, [dict(summarize(s, iters=iters), interleaved=True)
                  for s in samples]


def _batch_ms(fn, arg_sets, iters: int, first: int) -> float:
  """Per-call ms of ``iters`` back-to-back calls, input sets from ``first`` on.

  One block at the end: each device executes in order, so the last output
  being ready means all are.
  """
  import jax  # Lazy, see the module docstring.

  t0 = time.perf_counter()
  for k in range(first, first + iters):
    out = fn(*arg_sets[k % len(arg_sets)])
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) * 1e3 / iters


_pending: list | None = None


@contextlib.contextmanager
def interleaved(enabled: bool = True, around=None):
  """Within the block, `time_jax` compiles and warms up only; on exit every
  registered function is timed round-robin and its result dict filled in.

  Args:
    enabled: False makes this a no-op (plain sequential timing).
    around: a context manager entered for the round-robin alone (e.g. a
      `gpu_monitor.Monitor`, so that compiling is not sampled).
  """
  global _pending
  if not enabled or _pending is not None:
    yield
    return
  _pending = []
  try:
    yield
    with around if around is not None else contextlib.nullcontext():
      _time_round_robin(_pending)
  finally:
    _pending = None


def _time_round_robin(entries) -> None:
  import jax  # Lazy, see the module docstring.

  if not entries:
    return
  rounds = max(e[2] for e in entries)
  samples: list[list[float]] = [[] for _ in entries]
  counters = [0] * len(entries)
  failed: dict[int, str] = {}
  for r in range(rounds):
    for i in round_order(len(entries), r):
      fn, arg_sets, n_rounds, iters, res = entries[i]
      if i in failed or r >= n_rounds:
        continue
      try:
        # Untimed calls of this same program first: the previous block ran
        # another one and left the device in its state.
        settle = res["settle_calls"]
        for k in range(counters[i], counters[i] + settle):
          out = fn(*arg_sets[k % len(arg_sets)])
        jax.block_until_ready(out)
        del out
        counters[i] += settle
        samples[i].append(_batch_ms(fn, arg_sets, iters, counters[i]))
        counters[i] += iters
      except Exception as e:  # pylint: disable=broad-except
        failed[i] = f"{type(e).__name__}: {e}"[:1500]
  for i, (_, _, _, iters, res) in enumerate(entries):
    if i in failed:
      res["error"] = failed[i]
    elif samples[i]:
      res.update(summarize(samples[i], iters=iters))


def time_torch(
    fn: Callable[[int], Any],
    *,
    num_arg_sets: int = 1,
    warmup: int = WARMUP,
    rounds: int = ROUNDS,
    iters: int = ITERS,
    barrier: Callable[[], None] | None = None,
) -> dict[str, Any]:
  """Times a torch callable with the same method, using CUDA events.

  Without CUDA (smoke runs) it falls back to the host clock.

  Args:
    fn: called as ``fn(i)`` where ``i`` selects the input set.
    num_arg_sets: how many input sets ``fn`` rotates through.
    barrier: called (after a device synchronize) before every round, so that
      all ranks start a round together (e.g. ``torch.distributed.barrier``).

  Returns:
    Like `time_jax`, without the compile time.
  """
  import torch  # Lazy, see the module docstring.

  cuda = torch.cuda.is_available()
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  for i in range(max(1, warmup)):
    fn(i % num_arg_sets)
  sync()
  per_call = []
  k = 0
  for _ in range(rounds):
    if barrier is not None:
      barrier()
      sync()
    if cuda:
      start = torch.cuda.Event(enable_timing=True)
      end = torch.cuda.Event(enable_timing=True)
      start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
      fn(k % num_arg_sets)
      k += 1
    if cuda:
      end.record()
      end.synchronize()
      per_call.append(start.elapsed_time(end) / iters)
    else:  # CPU smoke runs: torch ops on CPU are synchronous.
      per_call.append((time.perf_counter() - t0) * 1e3 / iters)
  return summarize(per_call, iters=iters)
