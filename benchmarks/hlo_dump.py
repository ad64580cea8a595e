"""Compiled HLO of one matmul_reduce_scatter schedule, and what it launches.

Writes XLA's optimized HLO (after its passes, as it runs on the devices) and
prints how many of each kernel kind the entry computation launches: custom
calls by target, fusions, and the instructions computing the rank
(``partition-id``), so one can check that the Pallas pieces of an op share
one rank operand (`chunk_matmul.ByRank`) and that nothing else was added.

  python3 benchmarks/hlo_dump.py --m=4096 --k=14336 --n=4096 \
      --schedule=direct/c1/dma/pallas --out=/tmp/rs.hlo.txt
"""

from __future__ import annotations

import collections
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import common  # noqa: E402
import ficco_jax  # noqa: E402

_M = flags.DEFINE_integer("m", 4096, "Global rows M.")
_K = flags.DEFINE_integer("k", 14336, "Global K (sharded).")
_N = flags.DEFINE_integer("n", 4096, "Columns N.")
_W = flags.DEFINE_integer("w", 4, "Devices on the axis.")
_SCHEDULE = flags.DEFINE_string("schedule", "direct/c1/dma/pallas",
                                "Schedule label.")
_OUT = flags.DEFINE_string("out", "/tmp/rs.hlo.txt", "Where the HLO goes.")


def main(argv):
  del argv
  mesh = common.mesh_of(_W.value)
  sched = ficco_jax.Schedule.from_short(_SCHEDULE.value)
  body = functools.partial(ficco_jax.matmul_reduce_scatter, axis_name="x",
                           schedule=sched)
  # check_vma=False: jax's Pallas interpreter (CPU runs) rejects it.
  f = common.jit_shard_map(body, mesh, (P(None, "x"), P("x", None)),
                           P("x", None),
                           check_vma=jax.default_backend() != "cpu")
  h = jax.ShapeDtypeStruct((_M.value, _K.value), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((_K.value, _N.value), jnp.bfloat16)
  text = f.lower(h, w).compile().as_text()
  with open(_OUT.value, "w") as fh:
    fh.write(text)
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  targets = collections.Counter(
      re.findall(r'custom_call_target="([^"]+)"', entry))
  print(f"schedule {sched.short()}, {_M.value}x{_K.value}x{_N.value},"
        f" jax {jax.__version__}, {jax.devices()[0].device_kind}")
  print("entry custom calls:", dict(targets))
  print("entry fusions:", len(re.findall(r"= \S+ fusion\(", entry)))
  print("entry command buffers:", entry.count("command_buffer"))
  print("partition-id anywhere:", text.count("partition-id("))
  print(f"wrote {_OUT.value} ({len(text)} chars)")


if __name__ == "__main__":
  app.run(main)
