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


@pytest.mark.parametrize("schedule", [
    None, Schedule(dataflow="direct", num_chunks=1, comm="dma")],
    ids=["default", "direct/c1/dma"])
def test_scanned_layers_train_and_prefill_like_the_reference(schedule):
  """Three blocks under lax.scan, rematerialized: the copy engines' calls
  repeat per layer inside one compiled body."""
  cfg = tpt.Config(d_model=32, heads=4, d_ff=64, dtype=np.float32, layers=3,
                   remat=True)
  mesh = _mesh()
  params = tpt.init_params(jax.random.key(0), cfg, mesh)
  assert params["wqkv"].shape == (3, 32, 96)
  x, y = tpt.make_batch(jax.random.key(7), cfg, mesh, BATCH, SEQ)
  fwd = [float(tpt.make_forward(cfg, mesh, use_ficco=u, schedule=schedule)(
      params, x, y)) for u in (True, False)]
  tpt.check_losses(fwd[:1], fwd[1:], rtol=1e-3 if util.on_gpu() else 1e-4)
  losses = []
  for use_ficco in (True, False):
    p, opt = params, tpt.adam_init(params)
    step = tpt.make_train_step(cfg, mesh, use_ficco=use_ficco,
                               schedule=schedule, lr=1e-2)
    run = []
    for i in range(STEPS):
      p, opt, loss = step(p, opt, *tpt.make_batch(jax.random.key(100 + i),
                                                  cfg, mesh, BATCH, SEQ))
      run.append(float(loss))
    losses.append(run)
  tpt.check_losses(losses[0], losses[1], rtol=1e-3 if util.on_gpu() else 1e-4)
  assert losses[0][1] < losses[0][0], losses


def test_flops_per_step_counts_layers_and_training():
  cfg = tpt.Config(d_model=64, heads=8, d_ff=256, layers=2)
  fwd = tpt.flops_per_step(cfg, 2, 16, train=False)
  one = 2 * 32 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 2 * 16 * 16 * 64
  assert fwd == 2 * one
  assert tpt.flops_per_step(cfg, 2, 16, train=True) == 3 * fwd
  with pytest.raises(ValueError, match="layers=0"):
    tpt.Config(d_model=64, heads=8, d_ff=256, layers=0)


def test_one_layer_runs_no_loop():
  """layers=1 is the single block's program: a one-trip scan would keep a
  loop around the copy engines' side-effecting calls (XLA drops it only in
  XLA's program), which would change what the step benchmark compares."""
  mesh = _mesh()
  params = tpt.init_params(jax.random.key(0), CFG, mesh)
  assert params["wqkv"].sharding.spec == tpt.param_specs(CFG)["wqkv"]
  assert tpt.param_specs(CFG)["wqkv"] == jax.sharding.PartitionSpec(
      None, None, "tp")  # The layer axis is never sharded.
  x, y = tpt.make_batch(jax.random.key(1), CFG, mesh, BATCH, SEQ)
  step = tpt.make_train_step(
      CFG, mesh, use_ficco=True,
      schedule=Schedule(dataflow="direct", num_chunks=1, comm="dma"))
  hlo = step.lower(params, tpt.adam_init(params), x, y).compile().as_text()
  assert " while(" not in hlo
