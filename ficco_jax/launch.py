"""Start N local JAX processes: ``python -m ficco_jax.launch -n N script.py``."""

import sys

from ficco_jax._src.launch import count_gpus as count_gpus
from ficco_jax._src.launch import initialize_from_env as initialize_from_env
from ficco_jax._src.launch import launch as launch
from ficco_jax._src.launch import main as main

if __name__ == "__main__":
  sys.exit(main())
