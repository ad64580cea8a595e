"""Global-array (pjit-style) forms of the ficco_jax collective matmuls."""

from ficco_jax._src.sharded import all_gather_matmul as all_gather_matmul
from ficco_jax._src.sharded import matmul_reduce_scatter as matmul_reduce_scatter
