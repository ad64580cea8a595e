"""Ops on a CPU mesh plan and compile for the CPU where the default backend
is a GPU: a one-GPU host's tests run on the virtual CPU devices, and users
check a model against a CPU run. Here the default backend is made to read
"gpu" while the mesh is of CPU devices; deciding by it would send CPU
buffers to the Hopper kernel (which failed on a one-GPU H200)."""

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import ficco_jax
from ficco_jax._src import devices
import util


@pytest.fixture
def cpu_mesh(monkeypatch):
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  return mesh


def test_the_traced_mesh_decides_the_platform(cpu_mesh):
  seen = []

  def body(x):
    seen.append((devices.platform(), devices.device_kind(), devices.num_sms()))
    return x

  x = util.put(cpu_mesh, P("x"), np.zeros(4, np.float32))
  jax.jit(jax.shard_map(body, mesh=cpu_mesh, in_specs=P("x"),
                        out_specs=P("x")))(x)
  assert seen == [("cpu", jax.devices("cpu")[0].device_kind, 1)]
  assert devices.mesh_platform(cpu_mesh) == "cpu"


@pytest.mark.parametrize("op,schedule", [
    ("ag", None),
    ("ag", ficco_jax.Schedule(dataflow="direct", num_chunks=2, comm="dma",
                              compute="pallas")),
    ("rs", None),
    ("rs", ficco_jax.Schedule(dataflow="direct", num_chunks=1, comm="dma",
                              compute="pallas",
                              compute_granularity="flagged")),
])
def test_ops_run_on_a_cpu_mesh_when_the_default_backend_is_a_gpu(
    cpu_mesh, op, schedule):
  rng = np.random.default_rng(3)
  # Pallas's interpreter does not take shard_map's varying-axes checks.
  kw = dict(schedule=schedule, check_vma=schedule is None)
  if op == "ag":
    x, w = util.rand(rng, (96, 40), np.float32), util.rand(rng, (40, 24),
                                                           np.float32)
    out = util.run_ag(cpu_mesh, x, w, **kw)
    ref = util.ref_all_gather_matmul(x, w)
  else:
    x, w = util.rand(rng, (96, 48), np.float32), util.rand(rng, (48, 40),
                                                           np.float32)
    out = util.run_rs(cpu_mesh, x, w, **kw)
    ref = util.ref_matmul_reduce_scatter(x, w)
  assert util.rel_err(out, ref) < 1e-5
