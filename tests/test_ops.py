"""Every schedule of both ops against a float64 reference, inside jit(shard_map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
import util

OVERLAPPED = [Schedule(dataflow=d, num_chunks=c)
              for d in ("direct", "ring", "bidirectional") for c in (1, 2, 3)]
SCHEDULES = [ficco_jax.Schedule(dataflow="none")] + OVERLAPPED


def _ids(schedules):
  return [s.short() for s in schedules]


def with_comm(schedules, comm):
  return [Schedule(dataflow=s.dataflow, num_chunks=s.num_chunks, comm=comm)
          for s in schedules if s.overlapped]


def run_ag(mesh, x, w, *, axis="x", gather_axis=0, x_spec=None,
           check_vma=True, **kw):
  x_spec = x_spec or P(*([None] * gather_axis), axis)
  out_spec = list(x_spec) + [None] * (x.ndim - len(x_spec))
  out_spec[gather_axis] = None
  out_spec[-1] = axis
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.all_gather_matmul, axis_name=axis,
                        gather_axis=gather_axis, **kw),
      mesh=mesh, in_specs=(x_spec, P(None, axis)), out_specs=P(*out_spec),
      check_vma=check_vma))
  return f(jax.device_put(x, NamedSharding(mesh, x_spec)),
           jax.device_put(w, NamedSharding(mesh, P(None, axis))))


def run_rs(mesh, h, w, *, axis="x", scatter_axis=0, h_spec=None,
           check_vma=True, **kw):
  h_spec = h_spec or P(*([None] * (h.ndim - 1)), axis)
  out_spec = list(h_spec) + [None] * (h.ndim - len(h_spec))
  out_spec[-1] = None
  out_spec[scatter_axis] = axis
  f = jax.jit(jax.shard_map(
      functools.partial(ficco_jax.matmul_reduce_scatter, axis_name=axis,
                        scatter_axis=scatter_axis, **kw),
      mesh=mesh, in_specs=(h_spec, P(axis, None)), out_specs=P(*out_spec),
      check_vma=check_vma))
  return f(jax.device_put(h, NamedSharding(mesh, h_spec)),
           jax.device_put(w, NamedSharding(mesh, P(axis, None))))


@pytest.mark.parametrize("schedule", SCHEDULES + with_comm(OVERLAPPED, "dma"),
                         ids=_ids(SCHEDULES + with_comm(OVERLAPPED, "dma")))
def test_all_gather_matmul_f32(schedule):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(0)
  # Non-powers of two: 6 rows per device, K = 10, 7 columns per device.
  x, w = util.rand(rng, (24, 10), np.float32), util.rand(rng, (10, 28), np.float32)
  out = run_ag(mesh, x, w, schedule=schedule)
  assert out.dtype == np.float32
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(np.float32)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=_ids(SCHEDULES))
def test_matmul_reduce_scatter_f32(schedule):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(1)
  h, w = util.rand(rng, (24, 20), np.float32), util.rand(rng, (20, 9), np.float32)
  out = run_rs(mesh, h, w, schedule=schedule)
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float32)


BF16_CASES = [Schedule(dataflow="direct", num_chunks=2),
              Schedule(dataflow="ring", num_chunks=3),
              Schedule(dataflow="bidirectional", num_chunks=1),
              Schedule(dataflow="direct", num_chunks=3, comm="dma"),
              Schedule(dataflow="ring", num_chunks=2, comm="dma")]


@pytest.mark.parametrize("schedule", BF16_CASES, ids=_ids(BF16_CASES))
def test_bf16_on_8_devices(schedule):
  mesh = util.mesh((8,), ("x",))
  rng = np.random.default_rng(2)
  x, w = util.rand(rng, (48, 40), jnp.bfloat16), util.rand(rng, (40, 24), jnp.bfloat16)
  out = run_ag(mesh, x, w, schedule=schedule)
  assert out.dtype == jnp.bfloat16
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(jnp.bfloat16)
  if schedule.comm == "xla":
    h = util.rand(rng, (48, 40), jnp.bfloat16)
    out = run_rs(mesh, h, util.rand(rng, (40, 16), jnp.bfloat16) * 0 + w[:, :16],
                 schedule=schedule)
    ref = util.ref_matmul_reduce_scatter(h, w[:, :16])
    assert util.rel_err(out, ref) < util.tol(jnp.bfloat16)


def test_preferred_element_type_f32_from_bf16():
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(3)
  x, w = util.rand(rng, (24, 10), jnp.bfloat16), util.rand(rng, (10, 28), jnp.bfloat16)
  out = run_ag(mesh, x, w, schedule=Schedule(dataflow="direct", num_chunks=2),
               preferred_element_type=jnp.float32)
  assert out.dtype == np.float32
  # Products of bf16 values are exact in f32: only the f32 sums round.
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < 1e-5


@pytest.mark.parametrize("schedule", OVERLAPPED[::2] + with_comm(OVERLAPPED[::3], "dma"),
                         ids=_ids(OVERLAPPED[::2] + with_comm(OVERLAPPED[::3], "dma")))
def test_rank3_gather_axis_1(schedule):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(4)
  x, w = util.rand(rng, (3, 24, 5), np.float64), util.rand(rng, (5, 12), np.float64)
  out = run_ag(mesh, x, w, gather_axis=1, schedule=schedule)
  ref = np.einsum("bmk,kn->bmn", x, w)
  assert util.rel_err(out, ref) < util.tol(np.float64)


@pytest.mark.parametrize("schedule", OVERLAPPED[::2], ids=_ids(OVERLAPPED[::2]))
def test_rank3_scatter_axis_1(schedule):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(5)
  h, w = util.rand(rng, (3, 24, 8), np.float64), util.rand(rng, (8, 5), np.float64)
  out = run_rs(mesh, h, w, scatter_axis=1, schedule=schedule)
  assert util.rel_err(out, np.einsum("bmf,fn->bmn", h, w)) < util.tol(np.float64)


@pytest.mark.parametrize("comm", ["xla", "dma"])
def test_2d_mesh_dp_tp(comm):
  """Batch sharded over dp passes through; tp gathers inside each dp group."""
  mesh = util.mesh((2, 4), ("dp", "tp"))
  rng = np.random.default_rng(6)
  schedule = Schedule(dataflow="direct", num_chunks=2, comm=comm)
  x, w = util.rand(rng, (4, 24, 10), np.float32), util.rand(rng, (10, 28), np.float32)
  out = run_ag(mesh, x, w, axis="tp", gather_axis=1, x_spec=P("dp", "tp"),
               schedule=schedule)
  ref = np.einsum("bmk,kn->bmn", x.astype(np.float64), w)
  assert util.rel_err(out, ref) < util.tol(np.float32)
  if comm == "xla":
    h = util.rand(rng, (4, 24, 20), np.float32)
    w2 = util.rand(rng, (20, 9), np.float32)
    out = run_rs(mesh, h, w2, axis="tp", scatter_axis=1,
                 h_spec=P("dp", None, "tp"), schedule=schedule)
    ref = np.einsum("bmf,fn->bmn", h.astype(np.float64), w2)
    assert util.rel_err(out, ref) < util.tol(np.float32)


def test_default_schedule_is_reported_and_correct():
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(7)
  x, w = util.rand(rng, (24, 10), np.float32), util.rand(rng, (10, 28), np.float32)
  out = run_ag(mesh, x, w)
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(np.float32)
  chosen = ficco_jax.choose_schedule("all_gather_matmul", x_shape=(6, 10),
                                     w_shape=(10, 7), dtype=np.float32,
                                     axis_size=4)
  assert isinstance(chosen, Schedule)
  # A 6x10 shard is far too small to be worth overlapping.
  assert chosen.dataflow == "none"


@pytest.mark.parametrize("schedule", with_comm(OVERLAPPED, "dma"),
                         ids=_ids(with_comm(OVERLAPPED, "dma")))
def test_matmul_reduce_scatter_dma(schedule):
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(8)
  h, w = util.rand(rng, (24, 20), np.float32), util.rand(rng, (20, 9), np.float32)
  out = run_rs(mesh, h, w, schedule=schedule)
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float32)


ASYNC = [Schedule(dataflow="direct", num_chunks=2, comm="dma"),
         Schedule(dataflow="direct", num_chunks=1, comm="dma",
                  compute_granularity="step"),
         Schedule(dataflow="ring", num_chunks=3, comm="dma"),
         Schedule(dataflow="bidirectional", num_chunks=1, comm="dma")]


@pytest.mark.parametrize("schedule", ASYNC, ids=_ids(ASYNC))
def test_both_ops_dma_with_async_issue(schedule):
  """Both ops with async issue (each device's issuer thread waits for its
  peers and issues, start returns at once), on the CPU twin or the GPUs."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(10)
  h, w = util.rand(rng, (48, 20), np.float32), util.rand(rng, (20, 9), np.float32)
  x, wg = util.rand(rng, (24, 10), np.float32), util.rand(rng, (10, 20), np.float32)
  platform = "cuda" if mesh.devices.flat[0].platform == "gpu" else "cpu"
  previous = library.set_issue_mode("async", platform)
  try:
    for _ in range(3):  # Back to back: the issuers run behind the starts.
      rs = run_rs(mesh, h, w, schedule=schedule)
      ag = run_ag(mesh, x, wg, schedule=schedule)
    jax.block_until_ready((rs, ag))
  finally:
    library.set_issue_mode(previous, platform)
  assert util.rel_err(rs, util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float32)
  assert util.rel_err(ag, util.ref_all_gather_matmul(x, wg)) < util.tol(np.float32)


@pytest.mark.parametrize("dataflow", ["direct", "bidirectional"])
def test_matmul_reduce_scatter_dma_rank3_8_devices(dataflow):
  mesh = util.mesh((8,), ("x",))
  rng = np.random.default_rng(9)
  h, w = util.rand(rng, (2, 48, 16), np.float64), util.rand(rng, (16, 5), np.float64)
  out = run_rs(mesh, h, w, scatter_axis=1,
               schedule=Schedule(dataflow=dataflow, num_chunks=3, comm="dma"))
  assert util.rel_err(out, np.einsum("bmf,fn->bmn", h, w)) < util.tol(np.float64)


GRANULAR = [Schedule(dataflow="direct", num_chunks=c, comm=comm,
                    compute_granularity=g)
            for c, comm, g in ((1, "xla", "step"), (3, "xla", "step"),
                               (1, "dma", "step"), (3, "dma", "step"),
                               (2, "dma", "piece"), (3, "xla", "piece"),
                               (1, "dma", "halving"), (3, "dma", "halving"),
                               (2, "xla", "halving"))]


@pytest.mark.parametrize("schedule", GRANULAR, ids=_ids(GRANULAR))
def test_compute_granularity_both_ops(schedule):
  """Every granularity of the direct dataflow, both engines, on 4 devices
  (a step gathers 3 peers' rows, which wrap around the own block on every
  rank but the first; halving's first group 2 of them)."""
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(12)
  h, w = util.rand(rng, (2, 24, 12), np.float64), util.rand(rng, (12, 5), np.float64)
  out = run_rs(mesh, h, w, scatter_axis=1, schedule=schedule)
  assert util.rel_err(out, np.einsum("bmf,fn->bmn", h, w)) < util.tol(np.float64)
  if schedule.compute_granularity == "halving":
    return  # The reduce-scatter's only (test_errors checks the refusal).
  x, w2 = util.rand(rng, (24, 11), np.float64), util.rand(rng, (11, 20), np.float64)
  out = run_ag(mesh, x, w2, schedule=schedule)
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w2)) < util.tol(np.float64)


@pytest.mark.parametrize("comm", ["dma", "xla"])
def test_halving_granularity_8_devices(comm):
  """8 devices: halving's groups are 4 + 2 + 1 peers (each group's rows
  wrap around the own block differently on every rank)."""
  mesh = util.mesh((8,), ("x",))
  rng = np.random.default_rng(14)
  h, w = util.rand(rng, (80, 24), np.float64), util.rand(rng, (24, 7), np.float64)
  out = run_rs(mesh, h, w, schedule=Schedule(
      dataflow="direct", num_chunks=2, comm=comm,
      compute_granularity="halving"))
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float64)


def test_step_granularity_moves_the_same_bytes_in_fewer_starts():
  """The step reduce-scatter's program has one peer-copy start per chunk
  (the piece one P - 1, the halving one 2 on 4 devices), and all give the
  same result."""
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(13)
  h, w = util.rand(rng, (24, 8), np.float32), util.rand(rng, (8, 6), np.float32)
  texts = {}
  for g in ("step", "piece", "halving"):
    s = Schedule(dataflow="direct", num_chunks=2, comm="dma",
                 compute_granularity=g)
    f = jax.jit(jax.shard_map(
        functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                          schedule=s),
        mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
        out_specs=P("x", None)))
    args = (jax.device_put(h, NamedSharding(mesh, P(None, "x"))),
            jax.device_put(w, NamedSharding(mesh, P("x", None))))
    texts[g] = f.lower(*args).as_text()
    assert util.rel_err(f(*args), util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float32)
  starts = {g: t.count("ficco_peer_copy_start") for g, t in texts.items()}
  assert starts == {"step": 2, "piece": 6, "halving": 4}, starts


PALLAS = [Schedule(dataflow=d, num_chunks=c, comm=comm, compute="pallas",
                   compute_granularity=g)
          for d, c, comm, g in (("direct", 2, "xla", None),
                                ("ring", 3, "xla", None),
                                ("bidirectional", 1, "xla", None),
                                ("direct", 3, "dma", None),
                                ("ring", 2, "dma", None),
                                # One launch per step: the reduce-scatter
                                # reads 3 peers' wrapped rows in place, the
                                # all-gather writes 3 owners' rows.
                                ("direct", 1, "dma", "step"),
                                ("direct", 3, "xla", "step"))]
# The reduce-scatter's own rows add the peers' partials in the kernel's
# epilogue (the all-gather ignores the flag): one sync and one kernel per
# chunk, each chunk's kernel writing its rows of one result in place.
PALLAS += [Schedule(dataflow="direct", num_chunks=c, comm=comm,
                    compute="pallas", compute_granularity=g,
                    reduce_in_epilogue=True)
           for c, comm, g in ((1, "dma", None), (3, "dma", None),
                              (2, "dma", "step"), (2, "xla", None))]
# The reduce-scatter's halving granularity: two launches per chunk on 4
# devices, for 2 peers' wrapped rows, then 1 (the all-gather refuses it).
PALLAS += [Schedule(dataflow="direct", num_chunks=c, comm="dma",
                    compute="pallas", compute_granularity="halving")
           for c in (1, 3)]
# The reduce-scatter's flagged granularity: one kernel for every piece of
# the op, bumping a flag per piece that the copies wait for on the device,
# and one start (the all-gather refuses it).
PALLAS += [Schedule(dataflow="direct", num_chunks=c, comm="dma",
                    compute="pallas", compute_granularity="flagged")
           for c in (1, 3)]


@pytest.mark.parametrize("schedule", PALLAS, ids=_ids(PALLAS))
def test_pallas_compute(schedule):
  """Every dataflow with the Pallas chunk kernels (interpret mode on CPU).

  On GPUs the Hopper kernel needs bf16/f16 and tile-sized pieces; on CPUs the
  interpreter checks the offsets and in-place writes on small odd shapes.
  The interpreter rejects check_vma=True (a jax limitation), the Hopper
  kernel does not.
  """
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(13)
  if util.on_gpu():
    # Pieces must be whole Hopper tiles (multiples of 64 rows): 768 / 3.
    dtype, (m, k, n) = jnp.bfloat16, (768, 256, 128)
  else:
    dtype, (m, k, n) = np.float32, (6, 10, 7)
  x, w = util.rand(rng, (4 * m, k), dtype), util.rand(rng, (k, 4 * n), dtype)
  if schedule.compute_granularity not in ("halving", "flagged"):
    out = run_ag(mesh, x, w, schedule=schedule, check_vma=util.on_gpu())
    assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(dtype)
  h, w2 = util.rand(rng, (4 * m, 4 * n), dtype), util.rand(rng, (4 * n, k), dtype)
  out = run_rs(mesh, h, w2, schedule=schedule, check_vma=util.on_gpu())
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w2)) < util.tol(dtype)


@pytest.mark.parametrize("schedule", [PALLAS[3], PALLAS[5], PALLAS[1], PALLAS[8]],
                         ids=_ids([PALLAS[3], PALLAS[5], PALLAS[1], PALLAS[8]]))
def test_pallas_reduce_scatter_pads_k_to_whole_steps(schedule):
  """K = 96 per device leaves half a 64-deep step: h is zero-padded once per
  op (qwen2-72b's 7392 is the case that matters), w is read as it is."""
  mesh = util.mesh((4,), ("x",))
  rng = np.random.default_rng(17)
  m = 768 if util.on_gpu() else 6
  dtype = jnp.bfloat16
  h, w = util.rand(rng, (4 * m, 4 * 96), dtype), util.rand(rng, (4 * 96, 128), dtype)
  out = run_rs(mesh, h, w, schedule=schedule, check_vma=util.on_gpu())
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(dtype)
