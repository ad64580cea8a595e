"""The example transformer block trains like its XLA-collectives twin."""

import os
import re
import sys

import jax
import numpy as np
import pytest

from ficco_jax import Schedule
import util

pytestmark = pytest.mark.multigpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import tp_transformer as tpt  # pylint: disable=g-import-not-at-top

STEPS = 2
BATCH, SEQ = 4, 32  # Per device: 2 sequences of 8 tokens, 2 chunks of 4.
CFG = tpt.Config(d_model=32, heads=4, d_ff=64, dtype=np.float32)


def _mesh(explicit=False):
  m = util.mesh((2, 4), ("dp", "tp"))  # Skips where there are too few devices.
  return tpt.make_mesh(2, 4, devices=m.devices.flatten(), explicit=explicit)


def _train(mesh, *, use_ficco, schedule=None):
  """(losses, compiled HLO text) of STEPS Adam steps from a fixed seed."""
  params = tpt.init_params(jax.random.key(0), CFG, mesh)
  opt = tpt.adam_init(params)
  batches = [tpt.make_batch(jax.random.key(100 + i), CFG, mesh, BATCH, SEQ)
             for i in range(STEPS)]
  step = tpt.make_train_step(CFG, mesh, use_ficco=use_ficco,
                             schedule=schedule, lr=1e-2)
  step = step.lower(params, opt, *batches[0]).compile()  # Compiled once.
  losses = []
  for x, y in batches:
    params, opt, loss = step(params, opt, x, y)
    losses.append(float(loss))
  return losses, step.as_text()


@pytest.fixture(scope="module")
def reference():
  losses, _ = _train(_mesh(), use_ficco=False)
  return losses


@pytest.mark.parametrize("schedule,explicit", [
    (None, False), (Schedule(dataflow="bidirectional", num_chunks=2), False),
    (Schedule(dataflow="bidirectional", num_chunks=2), True)],
    ids=["default", "bidirectional/c2", "bidirectional/c2/explicit_axes"])
def test_losses_match_reference(schedule, explicit, reference):
  losses, hlo = _train(_mesh(explicit), use_ficco=True, schedule=schedule)
  # Same products summed in other orders: float32 rounding only (GPUs may
  # run float32 matmuls as tf32).
  tpt.check_losses(losses, reference, rtol=1e-3 if util.on_gpu() else 1e-4)
  assert losses[1] < losses[0], f"the loss did not go down: {losses}"
  if schedule is not None and schedule.overlapped:
    # The tensor-parallel collectives are all in ficco's pieces now; only the
    # data-parallel gradient all-reduces are left as XLA collectives.
    left = re.findall(r" (all-gather|reduce-scatter|all-to-all)(?:-start)?\(", hlo)
    assert not left, f"monolithic collectives left: {left}"


def test_parse_schedule():
  assert tpt.parse_schedule("default") is None
  assert tpt.parse_schedule("none") == Schedule(dataflow="none")
  assert tpt.parse_schedule("ring:2:dma") == Schedule(
      dataflow="ring", num_chunks=2, comm="dma")
  assert tpt.parse_schedule("direct/c4/xla/pallas") == Schedule(
      dataflow="direct", num_chunks=4, comm="xla", compute="pallas")
