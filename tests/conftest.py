"""Test setup: 8 virtual CPU devices, or the local GPUs where there are >= 2."""

import os

# Must happen before jax initialises its backends. Harmless on GPU hosts: it
# only sizes the CPU platform.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_enable_x64", True)
