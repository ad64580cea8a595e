"""ficco_jax: finer-grain compute-communication overlap for tensor-parallel matmuls.

The public API (everything else lives in the private ``ficco_jax._src``):

* `all_gather_matmul`, `matmul_reduce_scatter`: the overlapped collective
  matmuls, inside ``jax.shard_map``; `ficco_jax.sharded` has their forms on
  global arrays.
* `Schedule`: how an op is decomposed and overlapped; ``schedule=None``
  resolves through the autotune cache, then the cost-model heuristic.
* `choose_schedule`, `explain`: which schedule ``schedule=None`` runs, and
  why (for every op, the MoE ops included).
* `autotune`, `set_autotune_cache`: measure the candidates on your devices
  and cache the fastest (the MoE ops too); `autotune_model` does it for every call of a whole
  function (a training step, say) and times the step's gain.
* `all_to_all_matmul`, `matmul_all_to_all`: the expert-parallel (MoE)
  dispatch and combine with their grouped matmuls, a piece per peer.
* `ficco_jax.launch`: one local process per GPU.
"""

from ficco_jax import sharded as sharded
from ficco_jax._src.ops.all_gather_matmul.api import all_gather_matmul as all_gather_matmul
from ficco_jax._src.ops.matmul_reduce_scatter.api import matmul_reduce_scatter as matmul_reduce_scatter
from ficco_jax._src.ops.moe.api import all_to_all_matmul as all_to_all_matmul
from ficco_jax._src.ops.moe.api import matmul_all_to_all as matmul_all_to_all
from ficco_jax._src.resolve import choose_schedule as choose_schedule
from ficco_jax._src.schedule import Schedule as Schedule
from ficco_jax._src.tuning.autotune import autotune as autotune
from ficco_jax._src.tuning.autotune_cache import set_autotune_cache as set_autotune_cache
from ficco_jax._src.tuning.model_autotune import autotune_model as autotune_model
from ficco_jax._src.tuning.explain import explain as explain

__version__ = "0.1.0"
