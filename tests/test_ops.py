"""Both ops against a float64 reference, every schedule, engine and transport.

One harness per op (`test_all_gather_matmul`, `test_matmul_reduce_scatter`)
runs the whole design space inside ``jit(shard_map)`` on 4 devices (the
virtual CPU devices with the CPU twin of the copy-engine protocol, or the
GPUs): dataflows x chunk counts x comm engines x transports x compute
engines x granularities. The tests after them cover what the harness does
not vary: dtypes, ranks, meshes, the default schedule, issue modes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ficco_jax
from ficco_jax import Schedule
from ficco_jax._src import schedule as schedule_lib
import util

pytestmark = pytest.mark.multigpu

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
DATAFLOWS = ("direct", "ring", "bidirectional")


def _with_transports(schedules, transports):
  """Each copy-engine schedule once per transport (None: automatic)."""
  return [dataclasses.replace(s, transport=t)
          for s in schedules for t in transports]


def _cases(op):
  """The schedules the op's harness runs."""
  xla = [Schedule(dataflow=d, num_chunks=c) for d in DATAFLOWS
         for c in (1, 2, 3)]
  dma = _with_transports(
      [dataclasses.replace(s, comm="dma") for s in xla], (None, "window"))
  granular = [Schedule(dataflow="direct", num_chunks=c, comm=comm,
                       compute_granularity=g)
              for c, comm, g in ((1, "xla", "step"), (3, "xla", "step"),
                                 (1, "dma", "step"), (3, "dma", "step"),
                                 (2, "dma", "piece"), (3, "xla", "piece"))]
  granular += _with_transports(
      [Schedule(dataflow="direct", num_chunks=2, comm="dma",
                compute_granularity="step")], ("window",))
  pallas = [Schedule(dataflow=d, num_chunks=c, comm=comm, compute="pallas",
                     compute_granularity=g)
            for d, c, comm, g in (("direct", 2, "xla", None),
                                  ("ring", 3, "xla", None),
                                  ("bidirectional", 1, "xla", None),
                                  ("direct", 3, "dma", None),
                                  ("ring", 2, "dma", None),
                                  # One launch per step: the reduce-scatter
                                  # reads 3 peers' wrapped rows in place,
                                  # the all-gather writes 3 owners' rows.
                                  ("direct", 1, "dma", "step"),
                                  ("direct", 3, "xla", "step"))]
  cases = [Schedule(dataflow="none")] + xla + dma + granular + pallas
  if op == RS:
    halving = [Schedule(dataflow="direct", num_chunks=c, comm=comm,
                        compute=compute, compute_granularity="halving")
               for c, comm, compute in ((1, "dma", "xla"), (3, "dma", "xla"),
                                        (2, "xla", "xla"),
                                        (1, "dma", "pallas"),
                                        (3, "dma", "pallas"))]
    # The own rows add the peers' partials in the kernel's epilogue: one
    # sync and one kernel per chunk, each writing its rows in place.
    epilogue = [Schedule(dataflow="direct", num_chunks=c, comm=comm,
                         compute="pallas", compute_granularity=g,
                         reduce_in_epilogue=True)
                for c, comm, g in ((1, "dma", None), (3, "dma", None),
                                   (2, "dma", "step"), (2, "xla", None))]
    # One kernel for every piece, a flag per piece that the copies wait
    # for on the device, one start; pushed (the default) or pulled.
    flagged = _with_transports(
        [Schedule(dataflow="direct", num_chunks=c, comm="dma",
                  compute="pallas", compute_granularity="flagged")
         for c in (1, 3)], (None, "rendezvous"))
    cases += halving + epilogue + flagged
  else:
    # The push all-gather: each shard pushed into the peers' windows and
    # multiplied there behind a device-side wait for its flag, one call.
    cases += _with_transports(
        [Schedule(dataflow="direct", num_chunks=1, comm="dma",
                  compute_granularity="flagged")], (None, "push"))
    # The signalled all-gather: pulls behind landing flags, one kernel per
    # chunk that waits in the kernel for each piece's flag.
    cases += _with_transports(
        [Schedule(dataflow="direct", num_chunks=c, comm="dma",
                  compute="pallas", compute_granularity="flagged")
         for c in (1, 3)], (None, "window"))
  return cases


def _sizes(schedule):
  """(dtype, m, k, n, check_vma): rows per device, contraction, columns per
  device. Odd sizes on CPU; on GPUs the Hopper kernel needs bf16 and pieces
  of whole tiles (768 rows = 3 chunks of 256). Pallas's CPU interpreter
  does not type varying axes, so check_vma is off there."""
  if schedule.compute == "pallas":
    if util.on_gpu():
      return jnp.bfloat16, 768, 256, 128, True
    return np.float32, 6, 10, 7, False
  return np.float32, 6, 10, 7, True


def _calls(schedule):
  # Copy-engine programs run twice on fresh data: a second call reuses the
  # first's windows, flags and landing halves.
  return 2 if schedule.comm == "dma" else 1


@pytest.mark.parametrize("schedule", _cases(AG), ids=Schedule.short)
def test_all_gather_matmul(schedule):
  mesh = util.tp_mesh()
  p = mesh.devices.size
  rng = np.random.default_rng(0)
  dtype, m, k, n, check_vma = _sizes(schedule)
  for _ in range(_calls(schedule)):
    x, w = util.rand(rng, (p * m, k), dtype), util.rand(rng, (k, p * n), dtype)
    out = util.run_ag(mesh, x, w, schedule=schedule, check_vma=check_vma)
    assert out.dtype == dtype
    assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(dtype)


@pytest.mark.parametrize("schedule", _cases(RS), ids=Schedule.short)
def test_matmul_reduce_scatter(schedule):
  mesh = util.tp_mesh()
  p = mesh.devices.size
  rng = np.random.default_rng(1)
  dtype, m, k, n, check_vma = _sizes(schedule)
  for _ in range(_calls(schedule)):
    h = util.rand(rng, (p * m, p * n), dtype)
    w = util.rand(rng, (p * n, k), dtype)
    out = util.run_rs(mesh, h, w, schedule=schedule, check_vma=check_vma)
    assert out.dtype == dtype
    ref = util.ref_matmul_reduce_scatter(h, w)
    assert util.rel_err(out, ref) < util.tol(dtype)


BF16_CASES = [Schedule(dataflow="direct", num_chunks=2),
              Schedule(dataflow="ring", num_chunks=3),
              Schedule(dataflow="bidirectional", num_chunks=1),
              Schedule(dataflow="direct", num_chunks=3, comm="dma"),
              Schedule(dataflow="ring", num_chunks=2, comm="dma"),
              Schedule(dataflow="ring", num_chunks=2, comm="dma",
                       transport="window")]


@pytest.mark.parametrize("schedule", BF16_CASES, ids=Schedule.short)
def test_bf16_on_8_devices(schedule):
  mesh = util.mesh((8,), ("x",))
  rng = np.random.default_rng(2)
  x, w = util.rand(rng, (48, 40), jnp.bfloat16), util.rand(rng, (40, 24), jnp.bfloat16)
  out = util.run_ag(mesh, x, w, schedule=schedule)
  assert out.dtype == jnp.bfloat16
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(jnp.bfloat16)
  h, w2 = util.rand(rng, (48, 40), jnp.bfloat16), util.rand(rng, (40, 16), jnp.bfloat16)
  out = util.run_rs(mesh, h, w2, schedule=schedule)
  ref = util.ref_matmul_reduce_scatter(h, w2)
  assert util.rel_err(out, ref) < util.tol(jnp.bfloat16)


@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="direct", num_chunks=2),
    # Pallas pieces create the result themselves (no zero fill to type it).
    Schedule(dataflow="direct", num_chunks=1, comm="dma", compute="pallas"),
    Schedule(dataflow="ring", num_chunks=1, comm="dma", compute="pallas"),
    # The push all-gather's GEMM writes f32 from bf16 directly.
    Schedule(dataflow="direct", num_chunks=1, comm="dma",
             compute_granularity="flagged"),
], ids=Schedule.short)
def test_preferred_element_type_f32_from_bf16(schedule):
  mesh = util.tp_mesh()
  rng = np.random.default_rng(3)
  p = mesh.devices.size
  if util.on_gpu() and schedule.compute == "pallas":
    shape_x, shape_w = (128 * p, 64), (64, 256 * p)  # Whole Hopper tiles.
  else:
    shape_x, shape_w = (24, 10), (10, 28)
  x, w = util.rand(rng, shape_x, jnp.bfloat16), util.rand(rng, shape_w, jnp.bfloat16)
  out = util.run_ag(mesh, x, w, schedule=schedule,
                    preferred_element_type=jnp.float32,
                    check_vma=util.on_gpu() or schedule.compute != "pallas")
  assert out.dtype == np.float32
  # Products of bf16 values are exact in f32: only the f32 sums round.
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < 1e-5


def test_push_gather_f16_operands_to_a_bf16_result_past_f16s_range():
  """The push all-gather's GEMM writes f32 and rounds once to bf16, as
  XLA's dot does: not f16, whose sums past 65504 would be inf."""
  mesh = util.tp_mesh()
  rng = np.random.default_rng(6)
  x = (util.rand(rng, (24, 10), np.float32) * 100).astype(np.float16)
  w = (util.rand(rng, (10, 28), np.float32) * 100).astype(np.float16)
  out = util.run_ag(mesh, x, w, schedule=Schedule(
      dataflow="direct", comm="dma", compute_granularity="flagged"),
                    preferred_element_type=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  ref = util.ref_all_gather_matmul(x, w)
  assert np.abs(ref).max() > 65504  # Past f16's range.
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert util.rel_err(out, ref) < util.tol(jnp.bfloat16)


@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, np.float32],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("schedule", [
    Schedule(dataflow="direct", num_chunks=2),
    # The push all-gather's GEMM writes f64 from neither: it multiplies in
    # f64 instead of rounding to its inputs' type first.
    Schedule(dataflow="direct", num_chunks=1, comm="dma",
             compute_granularity="flagged"),
], ids=Schedule.short)
def test_preferred_element_type_f64_is_not_rounded_below_f64(schedule,
                                                             in_dtype):
  mesh = util.tp_mesh()
  rng = np.random.default_rng(5)
  x = util.rand(rng, (24, 10), in_dtype)
  w = util.rand(rng, (10, 28), in_dtype)
  out = util.run_ag(mesh, x, w, schedule=schedule,
                    preferred_element_type=np.float64)
  assert out.dtype == np.float64
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(
      np.float64)


RANK3 = [Schedule(dataflow=d, num_chunks=c) for d, c in
         (("direct", 1), ("ring", 3), ("bidirectional", 2))]
RANK3 += [dataclasses.replace(s, comm="dma") for s in RANK3]


@pytest.mark.parametrize("schedule", RANK3, ids=Schedule.short)
def test_rank3_operands_along_axis_1(schedule):
  mesh = util.tp_mesh()
  rng = np.random.default_rng(4)
  x, w = util.rand(rng, (3, 24, 5), np.float64), util.rand(rng, (5, 12), np.float64)
  out = util.run_ag(mesh, x, w, gather_axis=1, schedule=schedule)
  assert util.rel_err(out, np.einsum("bmk,kn->bmn", x, w)) < util.tol(np.float64)
  h, w2 = util.rand(rng, (3, 24, 8), np.float64), util.rand(rng, (8, 5), np.float64)
  out = util.run_rs(mesh, h, w2, scatter_axis=1, schedule=schedule)
  assert util.rel_err(out, np.einsum("bmf,fn->bmn", h, w2)) < util.tol(np.float64)


@pytest.mark.parametrize("dtypes", [(np.float64, np.float64),
                                    (jnp.bfloat16, np.float32),
                                    (np.float16, np.float16)],
                         ids=lambda d: "-".join(np.dtype(t).name for t in d))
def test_flagged_all_gather_rank3_and_dtypes(dtypes):
  """The push all-gather of a [b, S, K] activation gathered along S (rows
  fold, each rank's stay one block), in f64, f16 and mixed bf16 x f32
  (jax's promotion: the GEMM runs in f32), twice on fresh data."""
  mesh = util.tp_mesh()
  rng = np.random.default_rng(40)
  s = Schedule(dataflow="direct", comm="dma", compute_granularity="flagged")
  for _ in range(2):
    x = util.rand(rng, (3, 24, 5), dtypes[0])
    w = util.rand(rng, (5, 12), dtypes[1])
    out = util.run_ag(mesh, x, w, gather_axis=1, schedule=s)
    want = jnp.result_type(x.dtype, w.dtype)
    assert out.dtype == want
    ref = np.einsum("bmk,kn->bmn", np.asarray(x, np.float64),
                    np.asarray(w, np.float64))
    assert util.rel_err(out, ref) < util.tol(want)


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_flagged_rank3_sequence_parallel_operand(num_chunks):
  """A flagged reduce-scatter of a [b, S, F] activation (sequence-parallel
  output, batch first), forward and gradient: the kernel folds the middle
  dims into rows."""
  mesh = util.tp_mesh()
  p = mesh.devices.size
  rng = np.random.default_rng(18)
  gpu = util.on_gpu()
  dtype, s, f, n = ((jnp.bfloat16, p * 768, p * 64, 128) if gpu else
                    (np.float32, p * 6, p * 5, 7))
  schedule = Schedule(dataflow="direct", num_chunks=num_chunks, comm="dma",
                      compute="pallas", compute_granularity="flagged")
  h, w = util.rand(rng, (2, s, f), dtype), util.rand(rng, (f, n), dtype)
  out = util.run_rs(mesh, h, w, scatter_axis=1, h_spec=P(None, None, "x"),
                    schedule=schedule, check_vma=gpu)
  ref = np.einsum("bsf,fn->bsn", np.asarray(h, np.float64),
                  np.asarray(w, np.float64))
  assert util.rel_err(out, ref) < util.tol(dtype)
  op = functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                         scatter_axis=1, schedule=schedule)
  loss = jax.jit(jax.grad(lambda h, w: jnp.sum(jax.shard_map(
      op, mesh=mesh, in_specs=(P(None, None, "x"), P("x")),
      out_specs=P(None, "x"), check_vma=gpu)(h, w).astype(jnp.float32))))
  g = loss(util.put(mesh, P(None, None, "x"), h), util.put(mesh, P("x"), w))
  # d sum(h @ w) / dh = 1 @ w^T, the same row for every token.
  want = np.broadcast_to(np.asarray(w, np.float64).sum(1), h.shape)
  assert util.rel_err(g, want) < util.tol(dtype)


@pytest.mark.parametrize("comm", ["xla", "dma"])
def test_2d_mesh_dp_tp(comm):
  """Batch sharded over dp passes through; tp gathers inside each dp group."""
  mesh = util.mesh((2, 4), ("dp", "tp"))
  rng = np.random.default_rng(6)
  schedule = Schedule(dataflow="direct", num_chunks=2, comm=comm)
  x, w = util.rand(rng, (4, 24, 10), np.float32), util.rand(rng, (10, 28), np.float32)
  out = util.run_ag(mesh, x, w, axis="tp", gather_axis=1, x_spec=P("dp", "tp"),
                    schedule=schedule)
  ref = np.einsum("bmk,kn->bmn", x.astype(np.float64), w)
  assert util.rel_err(out, ref) < util.tol(np.float32)
  h = util.rand(rng, (4, 24, 20), np.float32)
  w2 = util.rand(rng, (20, 9), np.float32)
  out = util.run_rs(mesh, h, w2, axis="tp", scatter_axis=1,
                    h_spec=P("dp", None, "tp"), schedule=schedule)
  ref = np.einsum("bmf,fn->bmn", h.astype(np.float64), w2)
  assert util.rel_err(out, ref) < util.tol(np.float32)


def test_default_schedule_is_reported_and_correct():
  mesh = util.tp_mesh()
  rng = np.random.default_rng(7)
  x, w = util.rand(rng, (24, 10), np.float32), util.rand(rng, (10, 28), np.float32)
  out = util.run_ag(mesh, x, w)
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(np.float32)
  chosen = ficco_jax.choose_schedule(AG, x_shape=(6, 10), w_shape=(10, 7),
                                     dtype=np.float32, axis_size=4)
  assert isinstance(chosen, Schedule)
  # A 6x10 shard is far too small to be worth overlapping.
  assert chosen.dataflow == "none"


ASYNC = [Schedule(dataflow="direct", num_chunks=2, comm="dma"),
         Schedule(dataflow="direct", num_chunks=1, comm="dma",
                  compute_granularity="step"),
         Schedule(dataflow="ring", num_chunks=3, comm="dma"),
         Schedule(dataflow="bidirectional", num_chunks=1, comm="dma")]


@pytest.mark.parametrize("schedule", ASYNC, ids=Schedule.short)
def test_both_ops_dma_with_async_issue(schedule):
  """Both ops with async issue (each device's issuer thread waits for its
  peers and issues, start returns at once), on the CPU twin or the GPUs."""
  from ficco_jax._src.dma import library  # pylint: disable=g-import-not-at-top

  mesh = util.tp_mesh()
  rng = np.random.default_rng(10)
  h, w = util.rand(rng, (48, 20), np.float32), util.rand(rng, (20, 9), np.float32)
  x, wg = util.rand(rng, (24, 10), np.float32), util.rand(rng, (10, 20), np.float32)
  platform = util.platform_name()
  previous = library.set_issue_mode("async", platform)
  try:
    for _ in range(3):  # Back to back: the issuers run behind the starts.
      rs = util.run_rs(mesh, h, w, schedule=schedule)
      ag = util.run_ag(mesh, x, wg, schedule=schedule)
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
  out = util.run_rs(mesh, h, w, scatter_axis=1,
                    schedule=Schedule(dataflow=dataflow, num_chunks=3,
                                      comm="dma"))
  assert util.rel_err(out, np.einsum("bmf,fn->bmn", h, w)) < util.tol(np.float64)


@pytest.mark.parametrize("comm", ["dma", "xla"])
def test_halving_granularity_8_devices(comm):
  """8 devices: halving's groups are 4 + 2 + 1 peers (each group's rows
  wrap around the own block differently on every rank)."""
  mesh = util.mesh((8,), ("x",))
  rng = np.random.default_rng(14)
  h, w = util.rand(rng, (80, 24), np.float64), util.rand(rng, (24, 7), np.float64)
  out = util.run_rs(mesh, h, w, schedule=Schedule(
      dataflow="direct", num_chunks=2, comm=comm,
      compute_granularity="halving"))
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float64)


def test_step_granularity_moves_the_same_bytes_in_fewer_starts():
  """The step reduce-scatter's program has one peer-copy start per chunk
  (the piece one P - 1, the halving one 2 on 4 devices), and all give the
  same result."""
  mesh = util.tp_mesh()
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
    args = (util.put(mesh, P(None, "x"), h), util.put(mesh, P("x", None), w))
    texts[g] = f.lower(*args).as_text()
    assert util.rel_err(f(*args), util.ref_matmul_reduce_scatter(h, w)) < util.tol(np.float32)
  starts = {g: t.count("ficco_peer_copy_start") for g, t in texts.items()}
  p = mesh.devices.size
  halving = len(schedule_lib.halving_groups(p - 1))
  assert starts == {"step": 2, "piece": 2 * (p - 1), "halving": 2 * halving}, starts


PADS_K = [Schedule(dataflow=d, num_chunks=c, comm="dma", compute="pallas",
                   compute_granularity=g)
          for d, c, g in (("direct", 3, None), ("direct", 1, "step"),
                          ("ring", 2, None), ("direct", 1, "flagged"))]


@pytest.mark.parametrize("schedule", PADS_K, ids=Schedule.short)
def test_pallas_reduce_scatter_pads_k_to_whole_steps(schedule):
  """K = 96 per device leaves half a 64-deep step: h is zero-padded once per
  op (qwen2-72b's 7392 is the case that matters), w is read as it is."""
  mesh = util.tp_mesh()
  p = mesh.devices.size
  rng = np.random.default_rng(17)
  m = 768 if util.on_gpu() else 6
  dtype = jnp.bfloat16
  h, w = util.rand(rng, (p * m, p * 96), dtype), util.rand(rng, (p * 96, 128), dtype)
  out = util.run_rs(mesh, h, w, schedule=schedule, check_vma=util.on_gpu())
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w)) < util.tol(dtype)


@pytest.mark.parametrize("comm", ["xla", "dma"])
def test_mixed_dtypes_follow_jax_type_promotion(comm):
  """float16 x bfloat16 computes in float32, as ``all_gather(x) @ w`` and
  ``h @ w`` do, and the gradients keep their primals' dtypes."""
  mesh = util.tp_mesh()
  rng = np.random.default_rng(19)
  schedule = Schedule(dataflow="direct", num_chunks=2, comm=comm)
  x, w = util.rand(rng, (24, 10), np.float16), util.rand(rng, (10, 28), jnp.bfloat16)
  out = util.run_ag(mesh, x, w, schedule=schedule)
  assert out.dtype == jnp.result_type(x, w) == np.float32
  assert util.rel_err(out, util.ref_all_gather_matmul(x, w)) < util.tol(np.float32)
  h, w2 = util.rand(rng, (24, 20), jnp.bfloat16), util.rand(rng, (20, 9), np.float16)
  out = util.run_rs(mesh, h, w2, schedule=schedule)
  assert out.dtype == np.float32
  assert util.rel_err(out, util.ref_matmul_reduce_scatter(h, w2)) < util.tol(np.float32)
  op = functools.partial(ficco_jax.all_gather_matmul, axis_name="x",
                         schedule=schedule)
  grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jax.shard_map(
      op, mesh=mesh, in_specs=(P("x"), P(None, "x")),
      out_specs=P(None, "x"))(x, w)), argnums=(0, 1)))(
          util.put(mesh, P("x"), x), util.put(mesh, P(None, "x"), w))
  assert [g.dtype for g in grads] == [np.float16, jnp.bfloat16]
