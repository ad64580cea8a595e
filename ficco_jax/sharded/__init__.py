"""Global-array (pjit-style) forms of the ficco_jax collective matmuls and
MoE ops."""

from ficco_jax._src.sharded import all_gather_matmul as all_gather_matmul
from ficco_jax._src.sharded import matmul_reduce_scatter as matmul_reduce_scatter
from ficco_jax._src.ops.moe.sharded import all_to_all_matmul as all_to_all_matmul
from ficco_jax._src.ops.moe.sharded import matmul_all_to_all as matmul_all_to_all
