"""The reduce-scatter's direct dataflow on the copy engines, with the
``"piece"``, ``"step"`` and ``"halving"`` granularities.

Shapes as in `pieces`: ``h0 [P * m, *rest, F]``, ``w [F, N]``; chunks of
``mc = m / num_chunks`` rows.
"""

from __future__ import annotations

from jax import lax

from ficco_jax._src import vma
from ficco_jax._src.matmul import Static
from ficco_jax._src.ops.matmul_reduce_scatter import pieces


def forward(h0, w, st: Static, m, mc, out_dtype):
  """Direct dataflow: each partial leaves as soon as it is multiplied.

  Step (j, s) multiplies chunk j of the rows owned by rank ``r + s`` and hands
  it to the copy engines; rank ``r + s`` pulls it while this rank multiplies
  the next step's partial. The compute stream never waits for a copy until
  the end: the own rows' matmul hides the last pull, then one fused pass adds
  the P - 1 pulled partials to it. Every step is a permutation (each device
  sends one piece and receives one), so no device's inbound links are shared.

  With ``compute_granularity="step"`` a chunk's partials for all peers are
  one dot and one start (every peer pulls its slot at once, on its own
  queue): ``num_chunks`` starts instead of ``num_chunks (P - 1)``, for ops
  whose host time shows, while each chunk's partials leave only once all of
  them are computed. ``"halving"`` sits between: one dot and one start per
  peer group (`Schedule.peer_groups`), whose pulls overlap the later
  groups' dots. XLA's dot reads a group's rows gathered into one operand (a
  copy of them per group); the Pallas kernel reads them in place.

  Live buffers until the end: the (P - 1) partials for peers and the (P - 1)
  landing buffers, ``2 (P - 1) m`` rows of the output row size, against the
  ``P m`` rows of the full partial that XLA's matmul + reduce_scatter holds
  (the same with either granularity).
  """
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  kw = st.copy_kwargs()
  p = st.axis_size
  num_chunks = st.schedule.num_chunks
  groups = pieces.shift_groups(st)
  plans = [pieces.group_plan(p, mc, shifts) for shifts in groups]
  in_flight = []  # (chunk, part, landing, site) in issue order.

  def hand_over(j, part, plan):
    nonlocal h0
    site = peer_copy.new_site()
    landing = peer_copy.start([part], plan, site=site, **kw)[0]
    # The next matmul reads h0 through the barrier, so XLA cannot run it
    # before this start has handed the partial to the copy engines.
    h0, landing = lax.optimization_barrier((h0, landing))
    in_flight.append((j, part, landing, site))

  for j in range(num_chunks):
    for shifts, plan in zip(groups, plans):
      # One dot for the chunk's rows of the group's peers, one start for
      # all their pulls (a step's group is every peer: P - 1 times fewer
      # host rendezvous than piece by piece).
      part = pieces.peers_dot(h0, w, st, m, j * mc, mc, shifts)
      hand_over(j, part.astype(out_dtype), plan)
  if st.schedule.reduce_in_epilogue:
    return _own_rows_with_pulls(h0, w, st, m, mc, in_flight)
  own = pieces.rows_dot(h0, lambda r: r * m, m, w, st)
  # Wait only after the own rows' matmul was issued (it hides the last pull).
  landings = tuple(f[2] for f in in_flight)
  own, landings = lax.optimization_barrier((own, landings))
  # One call waits for every pulled partial and ends every invocation (the
  # partials for peers are free after it): on short ops each FFI call is
  # ~10 us of host time the device waits for. The price: the sum below also
  # waits until every peer has pulled this rank's partials, not only for
  # this rank's own pulls.
  pulled = peer_copy.sync([(buf, f[3]) for buf, f in zip(landings, in_flight)],
                          [([f[1]], f[3]) for f in in_flight], **kw)
  # A group's landing buffer holds one slot per peer of the group.
  slots = [(f[0], buf[slot * mc:(slot + 1) * mc])
           for f, buf in zip(in_flight, pulled)
           for slot in range(buf.shape[0] // mc)]
  return pieces.add_pulled(own, slots, num_chunks, mc, out_dtype)


def _own_rows_with_pulls(h0, w, st: Static, m, mc, in_flight):
  """The direct dataflow's end with ``reduce_in_epilogue``: chunk j's own
  rows multiplied by a kernel that adds chunk j's pulled partials.

  Chunk j's kernel waits for chunk j's pulls only, and is issued before the
  wait for chunk j + 1's, so it hides them (a sync per chunk, against one
  for the whole op without the epilogue). The last sync also ends every
  invocation: by symmetry the peers' pulls of this rank's last partial
  finish when this rank's own last pull does.
  """
  from ficco_jax._src.dma import peer_copy  # pylint: disable=g-import-not-at-top

  kw = st.copy_kwargs()
  num_chunks = st.schedule.num_chunks
  waited = {}  # site -> its landing buffer, once waited for.
  out = None  # The result, written chunk by chunk in place.
  for j in range(num_chunks):
    mine = [f for f in in_flight if f[0] == j]
    landings = tuple(f[2] for f in mine)
    # After every start (h0 went through each start's barrier) and, from
    # chunk 1 on, after the previous chunk's kernel: else XLA may wait for
    # these pulls before work that hides them.
    if out is None:
      _, landings = lax.optimization_barrier((h0, landings))
    else:
      out, landings = lax.optimization_barrier((out, landings))
    last = j == num_chunks - 1
    # The last sync ends every invocation; each keeps its waited landing
    # buffer alive too, so the end is ordered after its start by data.
    ends = [([f[1], waited[f[3]]] if f[0] != j else [f[1]], f[3])
            for f in in_flight] if last else []
    pulled = peer_copy.sync([(b, f[3]) for b, f in zip(landings, mine)],
                            ends, **kw)
    waited.update((f[3], b) for f, b in zip(mine, pulled))
    # A group's landing buffer holds one partial per peer, mc rows each.
    addends = [buf for buf in pulled for _ in range(buf.shape[0] // mc)]
    rows = [slot * mc for buf in pulled for slot in range(buf.shape[0] // mc)]
    # Each chunk's kernel writes its rows of one [m] result in place (a
    # concatenate would be one more pass over the result).
    out = pieces.rows_dot(h0, lambda r, j=j: r * m + j * mc, mc, w, st,
                          addends=addends, addend_rows=rows, out=out,
                          out_row=j * mc, total_rows=m)
  # Written in place chunk by chunk, the result is typed invariant (see
  # `chunk_matmul_pieces`'s fresh_rows); it varies as h0 and w do.
  return vma.vary_like(out, h0, w)
