"""Pallas compute kernels of ficco_jax (chunk matmuls that write in place)."""
