"""Transfer plans cover every piece exactly once and only forward what arrived."""

import pytest

from ficco_jax import Schedule
from ficco_jax._src import plan as plan_lib


@pytest.mark.parametrize("dataflow", ["direct", "ring", "bidirectional"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_plan_invariants(dataflow, p, chunks):
  m = 6
  gplan = plan_lib.gather_plan(Schedule(dataflow=dataflow, num_chunks=chunks),
                               axis_size=p, shard_rows=m)
  mc = m // chunks
  # Every row of every peer shard lands exactly once.
  pieces = sorted((b.owner_offset, b.owner_row) for b in gplan.blocks)
  assert pieces == sorted((o, c * mc) for o in range(1, p) for c in range(chunks))
  filled = {b: 0 for b in range(len(gplan.landing_rows))}
  for i, t in enumerate(gplan.transfers):
    assert 1 <= t.src_offset < p
    assert 0 <= t.stream < gplan.num_streams
    assert 0 <= t.dst_row and t.dst_row + t.rows <= gplan.landing_rows[t.dst]
    filled[t.dst] += t.rows
    if t.src < 0:
      # Forwarding reads a landing buffer that an earlier transfer fills.
      src = -1 - t.src
      assert any(u.dst == src for u in gplan.transfers[:i])
    else:
      assert t.src_row + t.rows <= m
  assert list(filled.values()) == list(gplan.landing_rows)
  if dataflow == "direct" and p > 1:
    # All peers are pulled at once, one queue per peer.
    assert gplan.num_streams == p - 1


def test_bidirectional_halves_the_steps():
  ring = plan_lib.gather_plan(Schedule(dataflow="ring"), axis_size=8, shard_rows=4)
  bidi = plan_lib.gather_plan(Schedule(dataflow="bidirectional"), axis_size=8,
                              shard_rows=4)
  longest = lambda g: max(abs(((b.owner_offset + 4) % 8) - 4) for b in g.blocks)
  assert longest(ring) == 7 or longest(ring) == 4  # offsets wrap: ring reaches -7
  assert longest(bidi) == 4
  assert bidi.num_streams == 2 and ring.num_streams == 1


def test_chunks_must_divide():
  with pytest.raises(ValueError, match=r"num_chunks=4 must divide .* \(6\)"):
    plan_lib.gather_plan(Schedule(num_chunks=4), axis_size=4, shard_rows=6)


@pytest.mark.parametrize("dataflow", ["direct", "ring", "bidirectional"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("c", [1, 2, 3])
def test_owner_pulls_deliver_the_same_rows_from_their_owners(dataflow, p, c):
  gplan = plan_lib.gather_plan(
      Schedule(dataflow=dataflow, num_chunks=c), axis_size=p,
      shard_rows=6)
  direct = plan_lib.owner_pulls(gplan)
  assert all(t.src == 0 for t in direct.transfers)
  assert direct.landing_rows == gplan.landing_rows
  assert direct.blocks == gplan.blocks
  for r in range(p):
    # Each landing row as (owner rank, owner row), from the transfers alone.
    land = [[None] * n for n in direct.landing_rows]
    for t in direct.transfers:
      owner = (r + t.src_offset) % p
      assert owner != r
      for i in range(t.rows):
        assert land[t.dst][t.dst_row + i] is None, "a row written twice"
        land[t.dst][t.dst_row + i] = (owner, t.src_row + i)
    for b in direct.blocks:
      for i in range(b.rows):
        want = ((r + b.owner_offset) % p, b.owner_row + i)
        assert land[b.landing][b.landing_row + i] == want
