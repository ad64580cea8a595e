"""ficco_jax: finer-grain compute-communication overlap for tensor-parallel matmuls."""

from ficco_jax import sharded as sharded
from ficco_jax._src.api import all_gather_matmul as all_gather_matmul
from ficco_jax._src.api import matmul_reduce_scatter as matmul_reduce_scatter
from ficco_jax._src.autotune import autotune as autotune
from ficco_jax._src.autotune_cache import set_autotune_cache as set_autotune_cache
from ficco_jax._src.explain import explain as explain
from ficco_jax._src.heuristics import choose_schedule as choose_schedule
from ficco_jax._src.schedule import Schedule as Schedule

__version__ = "0.1.0"
