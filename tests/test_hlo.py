"""The compiled program really is decomposed as the schedule says."""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src import plan as plan_lib
import util

pytestmark = pytest.mark.multigpu


def _count(text, op):
  return len(re.findall(rf"\b{op}(?:-start)?\(", text))


def _compiled(schedule, shape=(24, 10), n=28):
  mesh = util.mesh((4,), ("x",))
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                        schedule=schedule),
      mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
  x = jax.ShapeDtypeStruct(shape, np.float32,
                           sharding=NamedSharding(mesh, P("x")))
  w = jax.ShapeDtypeStruct((shape[1], n), np.float32,
                           sharding=NamedSharding(mesh, P(None, "x")))
  return f.lower(x, w).compile().as_text()


def test_no_overlap_is_one_all_gather():
  text = _compiled(Schedule(dataflow="none"))
  assert _count(text, "all-gather") == 1
  assert _count(text, "collective-permute") == 0


@pytest.mark.parametrize("dataflow", ["direct", "ring", "bidirectional"])
@pytest.mark.parametrize("comm", ["xla", "dma"])
def test_all_gather_writes_each_output_row_once(dataflow, comm):
  """No zero-filled result updated piece by piece (a write of the whole
  output and a copy of every piece): each piece's dot has its own buffer
  and one pass assembles them (compute="xla")."""
  text = _compiled(Schedule(dataflow=dataflow, num_chunks=3, comm=comm))
  assert _count(text, "dynamic-update-slice") == 0, text
  # The [24, 7] result per device: no broadcast constant of that shape.
  assert not re.search(r"f32\[24,7\]\{[^}]*\} broadcast\(", text), text


@pytest.mark.parametrize("dataflow", ["direct", "ring", "bidirectional"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_xla_comm_is_decomposed(dataflow, chunks):
  schedule = Schedule(dataflow=dataflow, num_chunks=chunks)
  text = _compiled(schedule)
  assert _count(text, "all-gather") == 0, "a monolithic all-gather is left"
  gplan = plan_lib.gather_plan(schedule, axis_size=4, shard_rows=6)
  permutes = _count(text, "collective-permute")
  if util.on_gpu():
    # XLA:GPU combines collective-permutes between the same device pairs, so
    # the pieces of one shard may travel together: still one permute per
    # step of the dataflow at least, never an all-gather.
    steps = len({(t.src_offset, t.src < 0, b.owner_offset) for t, b in
                 zip(gplan.transfers, gplan.blocks)})
    assert permutes >= min(steps, 3)
  else:
    # One permute per planned piece: XLA did not merge them back into shards.
    assert permutes == len(gplan.transfers)


@pytest.mark.parametrize("dataflow", ["direct", "ring"])
def test_dma_comm_has_no_collectives(dataflow):
  schedule = Schedule(dataflow=dataflow, num_chunks=2, comm="dma")
  text = _compiled(schedule)
  assert _count(text, "all-gather") == 0
  assert _count(text, "collective-permute") == 0
  gplan = plan_lib.gather_plan(schedule, axis_size=4, shard_rows=6)
  calls = lambda name: len(re.findall(rf'custom_call_target="{name}"', text))
  assert calls("ficco_peer_copy_start") == 1
  # One sync per landing buffer, then one for the done.
  assert calls("ficco_peer_copy_sync") == len(gplan.landing_rows) + 1


@pytest.mark.parametrize("dataflow,starts,syncs", [
    # P - 1 pulls, then one sync waits for all of them and ends them all.
    ("direct", 3, 1),
    # P - 1 hops, each waited for; one sync at the end ends them all.
    ("ring", 3, 4)])
def test_dma_reduce_scatter_ffi_calls(dataflow, starts, syncs):
  mesh = util.mesh((4,), ("x",))
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                        schedule=Schedule(dataflow=dataflow, comm="dma")),
      mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
  h = jax.ShapeDtypeStruct((24, 20), np.float32,
                           sharding=NamedSharding(mesh, P(None, "x")))
  w = jax.ShapeDtypeStruct((20, 9), np.float32,
                           sharding=NamedSharding(mesh, P("x")))
  text = f.lower(h, w).compile().as_text()
  calls = lambda name: len(re.findall(rf'custom_call_target="{name}"', text))
  assert calls("ficco_peer_copy_start") == starts
  assert calls("ficco_peer_copy_sync") == syncs
  assert _count(text, "reduce-scatter") == 0
