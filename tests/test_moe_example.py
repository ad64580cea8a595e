"""The example MoE layer trains like its ragged-op reference."""

import os
import sys

import numpy as np
import pytest

from ficco_jax import Schedule
import util

pytestmark = pytest.mark.multigpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import moe_layer  # pylint: disable=g-import-not-at-top


@pytest.mark.parametrize("schedule", [None, Schedule(dataflow="direct")],
                         ids=["default", "direct"])
def test_losses_equal_the_ragged_reference(schedule):
  mesh = util.tp_mesh(4, "ep")
  cfg = moe_layer.Config(experts=3 * mesh.devices.size, tokens=20,
                         top_k=2)
  ref = moe_layer.train(cfg, mesh, use_ficco=False, steps=3)
  got = moe_layer.train(cfg, mesh, use_ficco=True, steps=3,
                        schedule=schedule)
  np.testing.assert_allclose(got, ref, rtol=1e-5 if not util.on_gpu()
                             else 3e-3)
  assert ref[-1] < ref[0]  # It trains.
